"""lm-eval's own CLI (issue 41): ``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,tier=T4``
runs on a saved directory in a process that never imports elastic_ssm itself (transformers' remote-code loader
does), offline, on a local task; every logged log-likelihood equals our model's own at that tier. ESSH, ES-SSM
(``tier=K4``: its first 4 spectral channels) and MatFormer (``tier=T4``: its nested FFN prefix) directories alike."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is installed by the dev extra; CI runs these")

import elastic_ssm as es  # noqa: E402
from elastic_ssm import data  # noqa: E402
from elastic_ssm.config import MatFormerConfig  # noqa: E402
from elastic_ssm.models.baselines import MatFormer  # noqa: E402
from elastic_ssm.models.essh import randomize_selective  # noqa: E402

DOCS = [{"question": f"{a} + {b} =", "choices": [str(a + b), str(a + b + 1), "cat"], "label": 0}
        for a, b in [(1, 2), (3, 4), (2, 2)]]


def _task(folder):
    folder.mkdir(parents=True)
    (folder / "stock_choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "stock_choice.yaml").write_text(
        "task: stock_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'stock_choice.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")


def _ours(model, tier, context: str, continuation: str) -> float:
    ids = list(context.encode()) + list(continuation.encode())
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]), tier=tier).float(), -1)[0]
    n = len(continuation.encode())
    return logp[-n:].gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()


def _essh():
    return randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny")))


def _spread(model):
    with torch.no_grad():                     # weights wide enough that the tiers score differently
        for p in model.parameters():
            p.normal_(std=0.5)
    return model


MODELS = {"essh": (_essh, "T4"),
          "es_ssm": (lambda: _spread(es.ESSSM(es.ESSSMConfig.preset("tiny", vocab_size=260))), "K4"),
          "matformer": (lambda: _spread(MatFormer(MatFormerConfig.preset("tiny", vocab_size=260))), "T4")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_lm_eval_cli_scores_a_tier_of_a_saved_directory(tmp_path, arch):
    torch.manual_seed(0)
    build, tier = MODELS[arch]
    model = build().eval()
    model.tokenizer = data.load_tokenizer("bytes")
    model.save_pretrained(tmp_path / "model")
    _task(tmp_path / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    args = ["--model", "hf", "--model_args", f"pretrained={tmp_path / 'model'},trust_remote_code=True,tier={tier}",
            "--tasks", "stock_choice", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
            "--batch_size", "2", "--output_path", str(tmp_path / "out"), "--log_samples"]
    r = subprocess.run([sys.executable, "-m", "lm_eval", *args], capture_output=True, text=True, timeout=600,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_stock_choice_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for s in samples:
        for i, choice in enumerate(s["doc"]["choices"]):
            got = float(s["resps"][i][0][0])
            assert got == pytest.approx(_ours(model, tier, s["doc"]["question"], " " + choice), abs=1e-4)
            # the tier reached the model: the full model scores this pair otherwise
            assert abs(got - _ours(model, None, s["doc"]["question"], " " + choice)) > 1e-4


def test_stock_hf_model_keeps_an_es_ssm_input_within_its_filter_length(tmp_path):
    """lm-eval's ``hf`` model read no context length from an ES-SSM directory's config, took its 2048 default and
    crashed on a context longer than the filter length L (``T=201 exceeds the filter length L=128``); the config's
    ``max_position_embeddings`` is now L, so lm-eval keeps the last L tokens as our adapter does, and scores alike."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from elastic_ssm.eval.lm_harness import ElasticLM

    torch.manual_seed(0)
    model = es.ESSSM(es.ESSSMConfig.preset("tiny", vocab_size=260)).eval()
    model.tokenizer = data.load_tokenizer("bytes")
    model.save_pretrained(tmp_path / "m")
    theirs = HFLM(pretrained=str(tmp_path / "m"), trust_remote_code=True, tier="K4", device="cpu", batch_size=2)
    ours = ElasticLM(tmp_path / "m", tier="K4", batch_size=2)
    assert theirs.max_length == ours.max_length == model.config.seq_len == 128
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(c, x), idx=0)
            for c, x in [("a b " * 100, " c"), ("x", " y")]]
    assert [s for s, _ in theirs.loglikelihood(reqs)] == pytest.approx([s for s, _ in ours.loglikelihood(reqs)],
                                                                        abs=1e-4)
