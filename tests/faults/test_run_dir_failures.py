"""A run that meets a failure of its disk or of itself: flipped bytes in weights and checkpoints (sha256), a
read-only directory or file system, a full disk (before the first step, during a write, for the metrics file, a
real one mid run and then --resume), divergence, Ctrl-C. Each is one line that names what to do."""

import json
import os
import shutil
import signal
import warnings

import harness
import pytest
from test_run_dir import _copy, _one_line_error

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.models.model_dir import CheckpointError


def test_flipped_bytes_in_weights_and_checkpoints_are_detected(done, tmp_path, capsys):
    cfg, run = _copy(done, tmp_path)
    weights = run / "final" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0x10  # same size, one bit
    weights.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256"):
        es.models.load_pretrained(run / "final")
    assert main(["eval", str(run / "final"), "--seq_len", "16", "--batch_size", "1", "--n_batches", "1",
                 "--data", str(cfg.parent / "corpus.txt")]) == 2
    _one_line_error(capsys, str(weights), "checksum")
    for step in ("step_0000002", "step_0000001"):  # newest first: a warning and the older one; then an error
        opt = run / "pretrain" / step / "optimizer.pt"
        blob = bytearray(opt.read_bytes())
        blob[-20] ^= 0x01
        opt.write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="optimizer.pt: sha256 checksum mismatch"):
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume"]) == 2
    _one_line_error(capsys, "could be loaded", "step_0000001", "optimizer.pt")


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: permission bits do not stop root, so this "
                                               "platform cannot make a read-only directory for the test")
def test_read_only_out_dir(done, tmp_path, capsys):
    cfg, _ = done
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(ro / "run")]) == 2
        _one_line_error(capsys, "Permission denied", str(ro / "run"))
    finally:
        ro.chmod(0o700)


def test_read_only_file_system_message(done, tmp_path, capsys, monkeypatch):
    """A read-only mount (EROFS), simulated so that it runs as root too: one line naming the path."""
    import errno

    import elastic_ssm.train.rundir as rundir

    cfg, _ = done
    out = tmp_path / "mounted"
    out.mkdir()
    real_open = os.open

    def read_only(path, *a, **kw):
        if str(path).startswith(str(out)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(rundir.os, "open", read_only)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(out)]) == 2
    _one_line_error(capsys, "Read-only file system", str(out))
    assert list(out.iterdir()) == []


def test_full_disk_is_found_before_the_first_step_and_during_a_write(done, tmp_path, capsys, monkeypatch):
    cfg, _ = done
    import elastic_ssm.train.rundir as rundir

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 4096))
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(tmp_path / "full")]) == 2
    _one_line_error(capsys, "MiB free", "one checkpoint")
    assert not (tmp_path / "full" / "metrics.jsonl").exists()
    monkeypatch.undo()

    import elastic_ssm.train.checkpoint as ckpt

    def no_space(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "atomic_write_bytes", no_space)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(tmp_path / "full2")]) == 2
    _one_line_error(capsys, "No space left on device", "no checkpoint was written yet", "--resume auto")


def test_a_full_disk_for_the_metrics_file_names_it_and_the_checkpoint(done, tmp_path, capsys, monkeypatch):
    """``metrics.jsonl`` cannot grow at step 2 (a write() fails with ENOSPC and, as the OS does, no file name):
    one line naming the log, the disk and the checkpoint kept; after space is freed ``--resume`` logs every step
    once (the torn record dropped)."""
    import errno
    import pathlib

    cfg, _ = done
    out = tmp_path / "run"
    real_open = pathlib.Path.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])      # half a record reaches the disk, then no space is left
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(path, mode="r", *a, **kw):
        if path.name != "metrics.jsonl" or mode != "a" or not path.is_file():
            return real_open(path, mode, *a, **kw)
        with open(path) as log:                        # the builtin: Path.open is what this replaces
            steps = log.read().count('"kind": "train"')
        return Full(real_open(path, mode, *a, **kw)) if steps >= 1 else real_open(path, mode, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    argv = ["train", "--config", str(cfg), "--train.out_dir", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 2
        _one_line_error(capsys, str(out / "metrics.jsonl"), "No space left on device",
                        "the last complete checkpoint is", "step_0000001", "--resume")
        monkeypatch.undo()
        assert main([*argv, "--resume"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


def _mount_small_tmpfs(path, mib):
    """A real file system of ``mib`` MiB at ``path`` (needs root and mount rights; False where the platform cannot
    make one)."""
    import subprocess

    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_real_full_disk_mid_run_then_resume(tmp_path):
    """The disk fills up after step 3 (harness ``fill-disk``): the run stops at its next write with one line naming
    the file and the checkpoint; with the space freed, ``--resume`` finishes with every step logged once."""
    import subprocess

    mnt = tmp_path / "small"
    if not _mount_small_tmpfs(mnt, 12):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights) to make a real full disk")
    try:
        cfg = harness.write_run(tmp_path, steps=5)
        out = mnt / "run"
        rc, _, err = harness.run(cfg, out, fault="fill-disk:3")
        lines = [line for line in err.splitlines() if line.strip() and "step/s" not in line and "/s]" not in line]
        assert rc == 2 and len(lines) == 1, err
        assert "No space left on device" in lines[0] and str(out) in lines[0] and "step_0000002" in lines[0], lines
        (mnt / "filler").unlink()
        rc, _, err = harness.run(cfg, out, "--resume")
        assert rc == 0, err
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_divergence_names_the_step_the_checkpoint_and_what_to_try(done, tmp_path, capsys):
    cfg, _ = done
    out = tmp_path / "div"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["train", "--config", str(cfg), "--train.out_dir", str(out), "--train.optim.lr", "1e35",
                   "--train.optim.clip", "0", "--train.steps", "4"])
    assert rc == 2
    err = _one_line_error(capsys, "training diverged", "non-finite loss", "--train.optim.lr")
    assert "step_0000001" in err or "no checkpoint was written yet" in err


def test_sigint_checkpoints_and_exits_130(done, tmp_path, capsys, monkeypatch):
    """Ctrl-C during training (here delivered by the kernel to this process at step 2): the step finishes, a
    checkpoint is written, the command says so and exits 130; --resume then finishes the run."""
    from elastic_ssm.train.metrics import MetricsLogger

    cfg, _ = done
    out = tmp_path / "int"
    original = MetricsLogger.train_step

    def train_step(self, record, log):
        original(self, record, log)
        if record["step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(MetricsLogger, "train_step", train_step)
    argv = ["train", "--config", str(cfg), "--train.out_dir", str(out), "--train.steps", "4",
            "--train.checkpoint.every", "0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 128 + signal.SIGINT
        err = _one_line_error(capsys, "stopped by SIGINT after pretrain step 1", "--resume")
        assert (out / "pretrain" / "step_0000001" / "COMPLETE.json").is_file() and "step_0000001" in err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
        monkeypatch.setattr(MetricsLogger, "train_step", original)
        assert main([*argv, "--resume"]) == 0
    assert (out / "final" / "model.safetensors").is_file()
