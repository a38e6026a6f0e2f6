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


class _Reference:
    """The uninterrupted run, started once per module and awaited only where it is compared."""

    def __init__(self, root):
        self.cfg = harness.write_run(root, steps=7)
        self.out = root / "ref"
        self.proc = harness.start(self.cfg, self.out)

    def wait(self):
        if self.proc.returncode is None:
            _, err = self.proc.communicate(timeout=120)
            assert self.proc.returncode == 0, err
        return self.out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = _Reference(tmp_path_factory.mktemp("ref"))
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.communicate()


def _same_run(out, ref_out):
    """Bit-identical final weights and per-step losses, every step logged once, no temporary file left."""
    a, b = load_file(out / "final" / "model.safetensors"), load_file(ref_out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got, want = _train_losses(out), _train_losses(ref_out)
    assert [s for s, _ in got] == list(range(1, 8))
    assert got == want
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("seed", [0])
def test_kills_and_sigterm_then_resume_is_bit_exact(tmp_path, reference, seed):
    rng = random.Random(seed)
    cfg = reference.cfg
    out = tmp_path / "run"

    # 3 or 4 logged steps: at least 2 complete checkpoints (so the resumed save below prunes, keep_last=2) and
    # room for the faults that follow within the 7 steps
    assert _kill_after_steps(cfg, out, rng.randint(3, 4)) == -signal.SIGKILL
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
    _same_run(out, reference.wait())


def test_killed_in_the_first_checkpoint_then_resume_auto_starts_over(tmp_path, reference):
    """A run that dies inside its first checkpoint write has nothing to continue: ``--resume auto`` starts it
    over (its torn files removed, its log kept as metrics.prev-<time>.jsonl) and ends as the uninterrupted run."""
    out = tmp_path / "run"
    rc, _, err = harness.run(reference.cfg, out, fault="sigkill-write:model.safetensors")
    assert rc == -signal.SIGKILL, err
    assert list(out.glob("pretrain/.step_0000001.tmp/model/**/.model.safetensors.torn.tmp"))   # save's staging
    rc, stdout, err = harness.run(reference.cfg, out, "--resume", "auto")
    assert rc == 0, err
    assert "no checkpoint yet, starting" in stdout
    assert len(list(out.glob("metrics.prev-*.jsonl"))) == 1
    _same_run(out, reference.wait())


def test_sigterm_during_quickstart_is_a_stop_not_a_bug(tmp_path):
    """``elastic-ssm quickstart`` stopped by SIGTERM ends like ``train``: exit 143, one line naming the
    checkpoint, not the "unexpected ... probably a bug" line."""
    cfg = harness.write_run(tmp_path, steps=6)
    out = tmp_path / "qs"
    argv = [harness.sys.executable, str(harness.HERE / "harness.py"), "--fault", "sigterm-step:2", "quickstart",
            "--config", str(cfg), "--out", str(out), "--no_control"]
    p = harness.subprocess.run(argv, capture_output=True, text=True, env=harness._env(), cwd=str(tmp_path),
                               timeout=180)
    err = [line for line in p.stderr.splitlines() if line.strip() and "/s]" not in line and "step/s" not in line]
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    assert err and "elastic-ssm quickstart: stopped by SIGTERM" in err[-1] and "probably a bug" not in p.stderr
    assert "--resume" in err[-1] or "checkpoint" in err[-1]


def test_sigterm_during_the_final_save_lets_it_finish(tmp_path, reference):
    """A preemption signal that arrives while ``final/`` is written: the save completes (not a half-written
    ``final/`` and a silent exit by the default handler), the command says so and exits 0 as a finished run."""
    out = tmp_path / "run"
    rc, stdout, err = harness.run(reference.cfg, out, fault="sigterm-write:final/model.safetensors")
    assert rc == 0, err
    assert "SIGTERM arrived during the final save; the save finished" in stdout
    _same_run(out, reference.wait())
    assert (out / "final" / "config.json").is_file()
