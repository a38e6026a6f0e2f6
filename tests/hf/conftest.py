"""The saved tiny ESSH the HF test files load, and the fresh process that loads a directory with remote code."""

import json
import os
import subprocess
import sys

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.models.essh import randomize_selective


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny ESSH (gates moved off their identity start) with the byte tokenizer, saved."""
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny"))).eval()
    model.tokenizer = data.load_tokenizer("bytes")
    path = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(path)
    return model, path


CHILD = r"""
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path, tier = sys.argv[1], (sys.argv[2] or None)
kw = {"tier": tier} if tier else {}
cfg = AutoConfig.from_pretrained(path, trust_remote_code=True, **kw)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw)
tok = AutoTokenizer.from_pretrained(path)
ids = torch.tensor([tok("def foo(x):", add_special_tokens=False)["input_ids"]])
out = model.generate(ids, max_new_tokens=12, do_sample=False)
print(json.dumps({"config": type(cfg).__name__, "model": type(model).__name__, "tokens": out[0].tolist(),
                  "params": sum(p.numel() for p in model.parameters())}))
"""


@pytest.fixture(scope="session")
def remote_generate():
    """``remote_generate(path, tier="")``: load ``path`` with ``trust_remote_code=True`` in a fresh process that
    has imported nothing of ours (it checks so first), greedy-generate 12 tokens after "def foo(x):" and return
    ``{"config", "model", "tokens", "params"}``."""
    def run(path, tier=""):
        probe = "import sys; assert not [m for m in sys.modules if m.startswith('elastic_ssm')]\n"
        r = subprocess.run([sys.executable, "-c", probe + CHILD, str(path), tier], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return run
