"""The saved tiny ESSH both HF test files load."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.models.testing import randomize_selective


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny ESSH (gates moved off their identity start) with the byte tokenizer, saved."""
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny"))).eval()
    model.tokenizer = data.load_tokenizer("bytes")
    path = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(path)
    return model, path
