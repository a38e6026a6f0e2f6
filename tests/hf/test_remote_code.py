"""transformers without our import (issue 41): a saved ESSH directory carries ``auto_map`` and its remote-code
modules, so ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it in a fresh process
that never imported ``elastic_ssm``, and greedy ``generate`` there equals our own, at the full model and at a
sliced tier. Each check runs in a subprocess (the test process has imported elastic_ssm)."""

import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.model_dir import auto_map, remote_code

pytest.importorskip("transformers", reason="the hf extra is installed by the dev extra; CI runs these")

PROMPT = list(b"def foo(x):")


def test_the_directory_names_its_remote_code(saved):
    _, path = saved
    meta = json.loads((path / "config.json").read_text())
    assert meta["auto_map"] == auto_map("essh")
    for name, text in remote_code("essh").items():
        assert (path / name).read_text() == text


@pytest.mark.parametrize("tier", ["", "T4"])
def test_trust_remote_code_loads_and_generates_our_tokens(saved, tier, remote_generate):
    model, path = saved
    got = remote_generate(path, tier)
    assert got["config"] == "ESSHHFConfig" and got["model"] == "ESSHForCausalLM"
    assert got["params"] == model.num_parameters(tier or None)
    want = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, tier=tier or None)
    assert got["tokens"] == want[0].tolist()


def test_an_export_loads_the_same_way(saved, tmp_path, remote_generate):
    model, _ = saved
    small = es.export_tier(model, "T2")
    small.tokenizer = model.tokenizer
    small.save_pretrained(tmp_path / "t2")
    got = remote_generate(tmp_path / "t2")
    want = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, tier="T2")
    assert got["tokens"] == want[0].tolist()
