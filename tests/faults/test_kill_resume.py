"""Runs killed at random moments, inside checkpoint writes and while pruning, or stopped by SIGTERM, then
resumed: the final model and the logged losses are bit for bit those of an uninterrupted run, every step is
logged once, and no temporary file or half-deleted checkpoint is left behind."""

import json
import random
import signal
import time

import harness
import pytest
import torch
from safetensors.torch import load_file


def _train_losses(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def _kill_after_steps(cfg, out, n_steps, extra=()):
    """Start a run and SIGKILL it from outside once ``n_steps`` training records are logged (wherever the
    process happens to be then: a step, a checkpoint write, pruning)."""
    p = harness.start(cfg, out, *extra)
    deadline = time.time() + 120
    log = out / "metrics.jsonl"
    while time.time() < deadline and p.poll() is None:
        if log.is_file() and sum('"train"' in line for line in log.read_text().splitlines()) >= n_steps:
            break
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    return p.returncode


@pytest.mark.parametrize("seed", [0])
def test_kills_and_sigterm_then_resume_is_bit_exact(tmp_path, seed):
    rng = random.Random(seed)
    cfg = harness.write_run(tmp_path, steps=7)
    ref = harness.start(cfg, tmp_path / "ref")  # uninterrupted, in parallel with the faulty chain
    out = tmp_path / "run"

    assert _kill_after_steps(cfg, out, rng.randint(1, 3)) == -signal.SIGKILL
    rc, _, err = harness.run(cfg, out, "--resume", fault="sigkill-write:optimizer.pt")
    assert rc == -signal.SIGKILL, err
    assert list(out.glob("pretrain/.step_*.tmp"))  # the torn checkpoint write is there ...
    rc, _, err = harness.run(cfg, out, "--resume", fault="sigkill-prune:1")
    assert rc == -signal.SIGKILL, err
    assert not list(out.glob("pretrain/.step_*.tmp"))  # ... and was cleaned up by the next start
    half = [p for p in out.glob("pretrain/step_*") if not (p / "model").is_dir()]
    assert half, "the prune fault should leave a half-deleted checkpoint"
    last = max(s for s, _ in _train_losses(out))
    rc, _, err = harness.run(cfg, out, "--resume", fault=f"sigterm-step:{last + 1}")
    assert rc == 128 + signal.SIGTERM, err
    assert f"stopped by SIGTERM after pretrain step {last + 1}" in err and "--resume" in err
    assert (out / "pretrain" / f"step_{last + 1:07d}" / "COMPLETE.json").is_file()
    assert not any(p.exists() for p in half)
    rc, _, err = harness.run(cfg, out, "--resume")
    assert rc == 0, err

    ref_out, ref_err = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_err
    a, b = load_file(out / "final" / "model.safetensors"), load_file(tmp_path / "ref" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got, want = _train_losses(out), _train_losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, 8))  # each step logged exactly once
    assert got == want
    leftovers = [p for p in out.rglob("*") if ".tmp" in p.name]
    assert not leftovers
