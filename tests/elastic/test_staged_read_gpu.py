"""On CUDA, ``from_pretrained`` of a whole saved model reads it in staged reads (``elastic/slicing.py``): its
tensors equal the CPU load bitwise, a tier's load keeps the per-tensor path and equals the CPU tier, and the loaded
model saves again (its tensors are views of one buffer)."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.elastic.slicing import read_to_device

pytestmark = pytest.mark.gpu


@pytest.fixture
def saved(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA: deselect with -m 'not gpu'")
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_a_cuda_load_equals_the_cpu_load(saved, tmp_path):
    assert read_to_device(saved / "model.safetensors", "cuda", chunk=4096) is not None    # the staged path is taken
    for tier in (None, "T1"):
        cpu = es.ESSH.from_pretrained(saved, tier=tier).state_dict()
        gpu = es.ESSH.from_pretrained(saved, tier=tier, device="cuda").verified().state_dict()
        assert set(cpu) == set(gpu)
        for k, v in cpu.items():
            assert gpu[k].device.type == "cuda" and torch.equal(gpu[k].cpu(), v), (tier, k)
    whole = es.ESSH.from_pretrained(saved).state_dict()
    again = es.ESSH.from_pretrained(saved, device="cuda").verified()
    again.save_pretrained(tmp_path / "again")                  # views of one buffer save as separate tensors
    back = es.ESSH.from_pretrained(tmp_path / "again").state_dict()
    assert set(back) == set(whole) and all(torch.equal(back[k], v) for k, v in whole.items())
    ids = torch.randint(0, again.config.vocab_size, (1, 12), device="cuda")
    ref = es.ESSH.from_pretrained(saved)(ids.cpu())
    torch.testing.assert_close(again(ids).float().cpu(), ref.float(), rtol=1e-4, atol=1e-4)
