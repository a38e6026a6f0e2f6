"""Fixtures of the training tests."""

import pytest
import torch

import elastic_ssm as es


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a loaded shared machine two spinning OpenMP
    threads per process slow these tests down by up to 100x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_cfg():
    return es.ESSHConfig.preset("tiny")
