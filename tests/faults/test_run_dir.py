"""A run directory belongs to one run: reuse, a second writer, --overwrite, --resume refusals, a damaged run
directory, locks. Each refusal is one line and exit code 2, and leaves the directory as it was. Failures of the disk
or of the run itself: ``test_run_dir_failures.py``."""

import json
import os
import shutil
import signal
import time
import warnings

import harness
import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.train.checkpoint import file_sha256


def _copy(done, tmp_path):
    cfg, run = done
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return cfg, dst


def _snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _one_line_error(capsys, *needles):
    """The one error line (progress-bar lines of a run that started are not messages)."""
    text = capsys.readouterr().err
    lines = [line for line in text.splitlines() if line.strip() and "step/s" not in line and "?step" not in line]
    assert len(lines) == 1 and lines[0].startswith("elastic-ssm") and "Traceback" not in text, text
    err = lines[0]
    for n in needles:
        assert n in err, (n, err)
    return err


def test_reused_dir_is_refused_and_overwrite_moves_the_old_run_aside(done, tmp_path, capsys):
    cfg, run = _copy(done, tmp_path)
    before = _snapshot(run)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(run)]) == 2
    _one_line_error(capsys, str(run), "--resume", "--overwrite", "--train.out_dir")
    assert _snapshot(run) == before  # run.yaml, metrics, checkpoints untouched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == {k: v for k, v in before.items() if k != ".lock"}
    assert "moved the previous run" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["export", "final"])
def test_training_into_a_saved_model_is_refused_and_overwrite_moves_it_aside(done, tmp_path, capsys, what):
    """Issue 40 item 8: an export, a model folder or another run's final/ given as --train.out_dir was accepted,
    and eval / generate / from_pretrained on that folder then kept loading the old model."""
    cfg, run = _copy(done, tmp_path)
    model = es.ESSH.from_pretrained(run / "final")
    target = tmp_path / "model"
    if what == "export":
        es.export_tier(model, "T2").save_pretrained(target)
    else:
        shutil.copytree(run / "final", target)
    before = _snapshot(target)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(target)]) == 2
    _one_line_error(capsys, "saved model", "--overwrite", "--train.out_dir", str(target / "final"))
    assert _snapshot(target) == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(target), "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("model.replaced-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == before          # nothing the user saved is lost
    assert not (target / "config.json").exists() and (target / "final" / "config.json").is_file()


@pytest.mark.parametrize("change", [["--train.mixing.kl_coef", "0.3"], ["--train.mixing.alpha_ff", "0.25"],
                                    ["--train.mixing.capacities", "0.5", "1.0"], ["--model.d_ff", "128"],
                                    ["--data.max_train_bytes", "1000"], ["--train.seed", "1"],
                                    ["--train.micro_batch_size", "1"]])   # docs/data.md, "Resume": the CLI refuses it
def test_resume_refuses_objective_changes_and_leaves_the_run_untouched(done, tmp_path, capsys, change):
    cfg, run = _copy(done, tmp_path)
    before = _snapshot(run)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume", *change]) == 2
    _one_line_error(capsys, change[0].removeprefix("--"))
    assert _snapshot(run) == before


def test_resume_of_a_run_written_by_an_older_version_names_that(done, tmp_path, capsys):
    """A run.yaml without a setting this version has (written before the setting existed) is refused as an older
    run, naming the missing settings, not as if the user had changed them; nothing in the run is touched."""
    import yaml

    cfg, run = _copy(done, tmp_path)
    saved = yaml.safe_load((run / "run.yaml").read_text())
    del saved["train"]["tokens_per_step"], saved["train"]["refine"]["tokens_per_step"]
    (run / "run.yaml").write_text(yaml.safe_dump(saved))
    before = _snapshot(run)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume"]) == 2
    _one_line_error(capsys, "older elastic_ssm", "train.tokens_per_step", "train.refine.tokens_per_step",
                    "new --train.out_dir")
    assert _snapshot(run) == before


def test_resume_with_another_arch_names_the_arch(done, tmp_path, capsys):
    """Resuming an ESSH run as a Transformer++ is refused by its arch (every field differs, which must not read
    as a record written by an older version); nothing in the run is touched."""
    cfg, run = _copy(done, tmp_path)
    before = _snapshot(run)
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume", "--model.arch",
                 "transformer", "--model.preset", "tiny"]) == 2
    err = _one_line_error(capsys, "holds a 'essh' run", "--model.arch transformer", "another --train.out_dir")
    assert "older" not in err
    assert _snapshot(run) == before


def test_es_ssm_sequences_longer_than_its_filters_are_refused_before_anything_is_written(done, tmp_path, capsys):
    """An ES-SSM accepts at most its filter length (model.seq_len) tokens: a longer train.seq_len is one line naming
    both flags and values, before any data is read; no run directory, run.yaml or lock is left behind."""
    cfg, _ = done
    out = tmp_path / "x1" / "run"
    assert main(["train", "--config", str(cfg), "--model.arch", "es_ssm", "--model.preset", "tiny",
                 "--train.seq_len", "256", "--train.out_dir", str(out)]) == 2
    _one_line_error(capsys, "--train.seq_len 256", "--model.seq_len 128", "--train.seq_len 128 or less",
                    "--model.seq_len 256 or more")
    assert not (tmp_path / "x1").exists()


def _flat_train(train):
    """A train record as the version before the train sections wrote it (flat names, refine nested)."""
    from elastic_ssm.config.train import RECORD_RENAMES

    flat = {k: v for k, v in train.items() if not isinstance(v, dict) or k == "refine"}
    for old, path in RECORD_RENAMES.items():
        sec, sub = path.split(".")
        flat[old] = train[sec][sub]
    return flat


def test_resume_of_a_run_written_with_flat_train_names(done, tmp_path, capsys):
    """A run.yaml written before the train settings moved into sections (lr, n_warm_tokens, eval_every, ...)
    resumes when the settings are equal, and a changed one is named by its new path."""
    import yaml

    cfg, run = _copy(done, tmp_path)
    saved = yaml.safe_load((run / "run.yaml").read_text())
    flat = _flat_train(saved["train"])
    assert "lr" in flat and "optim" not in flat and flat["n_warm_tokens"] == 64
    (run / "run.yaml").write_text(yaml.safe_dump({**saved, "train": flat}, sort_keys=False))
    assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume",
                 "--train.mixing.kl_coef", "0.25"]) == 2
    _one_line_error(capsys, "train.mixing.kl_coef: 0.5 -> 0.25")
    (run / "run.yaml").write_text(yaml.safe_dump({**saved, "train": flat}, sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # an old record is mapped silently
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume"]) == 0
    assert yaml.safe_load((run / "run.yaml").read_text())["train"]["optim"]["lr"] == flat["lr"]


def test_python_resume_compares_the_checkpoints_train_config(tmp_path):
    """``train(resume=True)`` without a run.yaml compares against the TrainConfig stored in the checkpoint."""
    import torch

    from elastic_ssm.config import ConfigError
    from elastic_ssm.train import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(8)]
    cfg = TrainConfig(steps=3, micro_batch_size=2, seq_len=16, eval={"every": 0}, out_dir=str(tmp_path),
                      device="cpu", mixing={"n_warm_tokens": 0}, grad_accum=2)
    train(es.ESSHConfig.preset("tiny"), batches, cfg, progress=False, distributed=False, stop_after=1)
    for change in (dict(kl_coef=0.1), dict(alpha_ff=0.9), dict(full_share=0.5), dict(capacities=(0.5, 1.0))):
        with pytest.raises(ConfigError, match=next(iter(change))):
            train(es.ESSHConfig.preset("tiny"), batches, cfg.replace(mixing=cfg.mixing.replace(**change)),
                  resume=True, progress=False, distributed=False)
    res = train(es.ESSHConfig.preset("tiny"), batches,
                cfg.replace(log_every=5, checkpoint=cfg.checkpoint.replace(keep_last=1)), resume=True,
                progress=False, distributed=False)  # logging and retention may change
    assert [h["step"] for h in res.history] == [2, 3]


def test_resume_without_a_checkpoint_is_refused(done, tmp_path, capsys):
    cfg, run = _copy(done, tmp_path)
    shutil.rmtree(run / "pretrain")  # a finished model alone cannot continue training
    before = _snapshot(run)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "missing", empty, run):
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(out), "--resume"]) == 2
        _one_line_error(capsys, "no", "without --resume")
    assert not (tmp_path / "missing").exists() and not (empty / "run.yaml").exists()
    assert _snapshot(run) == before


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_stale(tmp_path, capsys):
    cfg = harness.write_run(tmp_path, steps=400)
    out = tmp_path / "busy"
    first = harness.start(cfg, out)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (out / "run.yaml").is_file():
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        holder = json.loads((out / ".lock").read_text())
        assert holder["pid"] == first.pid
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(out), "--resume"]) == 2
        _one_line_error(capsys, "in use by another run", f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    from elastic_ssm.train.rundir import RunLock

    with pytest.warns(UserWarning, match=f"stale lock of pid {first.pid}"):
        RunLock(out).acquire().release()


def test_resume_auto_starts_then_continues(done, tmp_path, capsys):
    """``--resume auto`` (a job requeued with one command): a fresh start without a checkpoint, a
    continuation with one; a directory holding only another run's final model is still refused."""
    cfg, _ = done
    out = tmp_path / "auto"
    argv = ["train", "--config", str(cfg), "--train.out_dir", str(out), "--resume", "auto"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 0
        assert "no checkpoint yet, starting" in capsys.readouterr().out
        assert main(argv) == 0
        assert "continuing the run" in capsys.readouterr().out
    shutil.rmtree(out / "pretrain")
    assert main(argv) == 2
    _one_line_error(capsys, "already holds another run", "final/")


def test_lock_without_file_locking_falls_back_to_the_holders_pid(tmp_path, monkeypatch):
    """On a file system without flock (ENOLCK) the recorded holder decides: alive on this host -> refused,
    dead -> its stale lock is taken over with a warning."""
    import errno
    import fcntl
    import socket
    import subprocess
    import sys

    from elastic_ssm.train.rundir import RunDirBusy, RunLock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_file = tmp_path / ".lock"
        lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid, "started": "t"}))
        with pytest.raises(RunDirBusy, match=f"pid {sleeper.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.warns(UserWarning, match=f"stale lock of pid {sleeper.pid}"):
        lock = RunLock(tmp_path).acquire()
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()


def test_concurrent_exports_into_one_folder_are_refused(done, tmp_path, capsys):
    """While one export writes a folder (its lock held), a second export there is refused with one line naming the
    holder, and writes nothing; once released, the export runs."""
    from elastic_ssm.train.rundir import RunLock

    _, run = done
    out = tmp_path / "exports"
    argv = ["export", str(run / "final"), "--out", str(out), "--tiers", "T1", "--check_len", "8", "--device", "cpu"]
    with RunLock(out, owner="export", flag="--out"):
        assert main(argv) == 2
        _one_line_error(capsys, str(out), "in use by another export", f"pid {os.getpid()}", "another --out")
        assert not (out / "T1").exists()
    assert main(argv) == 0
    assert (out / "T1" / "config.json").is_file()


@pytest.mark.parametrize("damage,needles", [
    (lambda run: (run / "run.yaml").write_text("model: {arch: essh\n"), ["run.yaml", "invalid YAML", "line 2"]),
    (lambda run: (run / "run.yaml").write_text(""), ["run.yaml", "not a run record"]),
    (lambda run: (run / "run.yaml").write_text("- 1\n"), ["run.yaml", "not a run record"]),
    (lambda run: (run / "run.yaml").write_bytes(bytes(range(256))), ["run.yaml", "not UTF-8"]),
    (lambda run: (run / "run.yaml").write_text((run / "run.yaml").read_text().replace("d_model: 64", "d_model: x")),
     ["run.yaml", "model section is invalid", "d_model"]),
    (lambda run: (run / "metrics.jsonl").write_bytes(bytes(range(256))), ["metrics.jsonl", "not a JSON-lines log"]),
    (lambda run: [(p / "COMPLETE.json").write_text("{") for p in (run / "pretrain").glob("step_*")],
     ["no complete checkpoint", "step_0000001", "incomplete or damaged"]),
])
def test_a_damaged_run_directory_is_named_on_resume(done, tmp_path, capsys, damage, needles):
    """The run record, the log or every checkpoint damaged: ``--resume`` names the file and what to do (never an
    AttributeError, a decode error without a file, or a comparison skipped as if the record were empty)."""
    cfg, run = _copy(done, tmp_path)
    damage(run)
    before = _snapshot(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume"]) == 2
    _one_line_error(capsys, *needles)
    assert _snapshot(run) == before


def test_resume_of_a_run_saved_before_tier_names_continues(done, tmp_path, capsys):
    """``model.tier_names`` came after runs were already being saved; a run.yaml or checkpoint without it meant
    T1..Tn, which is what the field's empty value means now, so such a run resumes (it was refused, first as
    'older elastic_ssm', then as 'a model with a different config')."""
    import yaml

    cfg, run = _copy(done, tmp_path)
    saved = yaml.safe_load((run / "run.yaml").read_text())
    assert saved["model"].pop("tier_names") == []
    (run / "run.yaml").write_text(yaml.safe_dump(saved))
    for ckpt in (run / "pretrain").glob("step_*"):       # and its checkpoints' model_config (with their checksums)
        trainer = torch.load(ckpt / "trainer.pt", weights_only=False)
        assert trainer["model_config"].pop("tier_names") == []
        torch.save(trainer, ckpt / "trainer.pt")
        meta = json.loads((ckpt / "COMPLETE.json").read_text())
        meta["sha256"]["trainer.pt"] = file_sha256(ckpt / "trainer.pt")
        meta["files"]["trainer.pt"] = (ckpt / "trainer.pt").stat().st_size
        (ckpt / "COMPLETE.json").write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(run), "--resume"]) == 0
    assert "older" not in capsys.readouterr().err
