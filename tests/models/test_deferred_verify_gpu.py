"""A CUDA load returns before the weights' checksum ends (``from_pretrained``'s ``defer_verify`` default on CUDA): the
first prefill overlaps it, and corrupted weights give no token: ``generate`` raises the checksum's
``CheckpointError`` (marker ``gpu``)."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.model_dir import CheckpointError

pytestmark = pytest.mark.gpu


def test_cuda_load_defers_the_check_and_refuses_corrupted_weights(tmp_path):
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3]], device="cuda")
    good = es.ESSH.from_pretrained(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert good.generate(ids, 4).shape == (1, 7) and good._weights_check is None
    blob = bytearray((tmp_path / "model.safetensors").read_bytes())
    blob[-5] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(blob))
    bad = es.ESSH.from_pretrained(tmp_path, device="cuda", dtype=torch.bfloat16)    # returns: the check runs on
    for _ in range(2):
        with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
            bad.generate(ids, 4)
