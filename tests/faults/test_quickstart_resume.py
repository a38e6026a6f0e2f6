"""``quickstart --resume`` (issue 40 item 12): a quickstart stopped by SIGTERM continues bit-exact, as ``train
--resume`` does; runs already finished are loaded, not trained again."""

from __future__ import annotations

import subprocess
import sys
import warnings

import harness
import pytest
import torch

from elastic_ssm.cli import main

TINY_RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: 3, micro_batch_size: 2, grad_accum: 2, seq_len: 32, device: cpu,
        mixing: {n_warm_tokens: 64}, ordering: {every: 2}, eval: {every: 0, batches: 1}, checkpoint: {every: 1},
        log_every: 1, refine: {steps: 2, tokens_per_step: 128}}
data: {source: CORPUS, tokenizer: bytes}
"""


def _quiet(argv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qsr")
    harness.write_run(root)
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY_RUN.replace("CORPUS", str(root / "corpus.txt")))
    assert _quiet(["quickstart", "--out", str(root / "whole"), "--config", str(cfg)]) == 0
    return root, cfg


def _same_weights(a, b):
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), (a, b)


def _same_outputs(a, b):
    assert (a / "tiers.csv").read_text() == (b / "tiers.csv").read_text()     # every tier's loss and bpb
    for name in ("T1", "T10"):
        _same_weights(a / "exports" / name / "model.safetensors", b / "exports" / name / "model.safetensors")
    _same_weights(a / "dense" / "final" / "model.safetensors", b / "dense" / "final" / "model.safetensors")


def test_quickstart_stopped_by_sigterm_resumes_bit_exact(setup, capsys):
    root, cfg = setup
    out = root / "cut"
    p = subprocess.run([sys.executable, str(harness.HERE / "harness.py"), "--fault", "sigterm-step:2", "quickstart",
                        "--out", str(out), "--config", str(cfg)], capture_output=True, text=True, env=harness._env(),
                       timeout=300)
    assert p.returncode == 143, p.stderr
    assert "continue with --resume" in p.stderr and not (out / "elastic" / "final").exists()
    assert _quiet(["quickstart", "--out", str(out), "--config", str(cfg), "--resume"]) == 0
    _same_outputs(root / "whole", out)
    capsys.readouterr()
    assert _quiet(["quickstart", "--out", str(out), "--config", str(cfg), "--resume"]) == 0   # both runs finished
    said = capsys.readouterr().out
    assert said.count("is finished; loading it") == 2 and "step 1" not in said, said
    _same_outputs(root / "whole", out)
    assert _quiet(["quickstart", "--out", str(out), "--config", str(cfg), "--resume", "--steps", "5"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "train.steps" in err[0], err          # a finished run is not loaded under other settings


def test_quickstart_stopped_in_every_stage_resumes_bit_exact(setup):
    """SIGTERM at step 2 of every stage it reaches (elastic pretrain and refine, dense pretrain and refine): each
    ``--resume`` goes one stage further, and the end equals the uninterrupted run."""
    root, cfg = setup
    out, stops = root / "every", []
    for attempt in range(8):
        p = subprocess.run([sys.executable, str(harness.HERE / "harness.py"), "--fault", "sigterm-step:2",
                            "quickstart", "--out", str(out), "--config", str(cfg), *(["--resume"] if attempt else [])],
                           capture_output=True, text=True, env=harness._env(), timeout=300)
        if p.returncode == 0:
            break
        assert p.returncode == 143, p.stderr
        stops.append(p.stderr.split("checkpoint ")[-1].split(";")[0])
    assert p.returncode == 0 and len(stops) == 4, stops
    assert [s.split("/")[-3:-1] for s in stops] == [["elastic", "pretrain"], ["elastic", "refine"],
                                                   ["dense", "pretrain"], ["dense", "refine"]], stops
    _same_outputs(root / "whole", out)


def test_quickstart_resume_without_a_run_is_one_line(tmp_path, capsys):
    assert _quiet(["quickstart", "--out", str(tmp_path / "none"), "--resume"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "holds no quickstart run" in err[0], err
    assert not (tmp_path / "none").exists()
