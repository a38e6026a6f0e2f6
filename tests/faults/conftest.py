"""Shared setup of the fault suites: a finished 2-step run (``test_run_dir.py``, ``test_run_dir_failures.py``)."""

import harness
import pytest


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished 2-step run (in process) and its run file."""
    return harness.trained_run(tmp_path_factory.mktemp("done"), 2)
