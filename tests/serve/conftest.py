"""The served test model: ESSH ``tiny`` with an untied head and active gates (``randomize_selective``), so
greedy text varies from token to token and from tier to tier, with the byte tokenizer; as a module and saved."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.models.essh import randomize_selective


def _varied_tiny():
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.5, True).eval()
    model.tokenizer = data.load_tokenizer("bytes")
    return model


@pytest.fixture(scope="module")
def tiny():
    return _varied_tiny()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """``tiny`` saved with ``save_pretrained`` (a model directory ``elastic-ssm serve`` loads)."""
    path = tmp_path_factory.mktemp("served") / "tiny"
    _varied_tiny().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """ESSH ``tiny`` as initialized (seed 0), saved with the byte tokenizer (a file may define its own)."""
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.tokenizer = data.load_tokenizer("bytes")
    path = tmp_path_factory.mktemp("m") / "tiny"
    model.save_pretrained(path)
    return path
