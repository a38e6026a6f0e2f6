"""Checks before the first training step (rank 0, verdict broadcast, before anything in ``out_dir`` is written: the
run directory, the evaluation tiers, free disk and, on resume, every setting that changes the objective), then
``run.yaml``; ``StopSignals``: SIGTERM and a first SIGINT stop after the current step with a checkpoint."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, TrainConfig, model_configs
from ..config.base import NOT_SAVED, config_changes
from ..utils.files import atomic_write_bytes, check_output_path
from .rundir import (
    RUN_RECORD,
    RunLock,
    check_free_disk,
    claim_run_dir,
    clean_stale_files,
    has_checkpoint,
    read_run_record,
    refuse_unusable_run,
)

__all__ = ["preflight", "start_run", "config_changes", "StopSignals", "TrainingInterrupted", "RUN_RECORD",
           "read_run_record", "check_same_arch"]

#: data settings a resumed run may change (validation only; the training stream must stay the same)
DATA_RESUME_FREE = frozenset({"val_source"})


class TrainingInterrupted(Exception):
    """Training stopped on a signal after a finished step; ``checkpoint`` is where it can be resumed."""

    def __init__(self, signame: str, stage: str, step: int, checkpoint: Path) -> None:
        self.signame, self.stage, self.step, self.checkpoint = signame, stage, step, checkpoint
        super().__init__(f"stopped by {signame} after {stage} step {step}; checkpoint {checkpoint}; continue with "
                         "--resume")


def check_same_arch(out: Path, saved: dict[str, Any], arch: str) -> None:
    """Refuse to resume run record ``saved`` as another architecture ``arch`` (named by its arch, not by field
    differences); a record without ``model.arch`` is an ESSH run."""
    was = saved["model"].get("arch", "essh")
    if was != arch:
        raise ConfigError(f"--resume: {out} holds a {was!r} run; --model.arch {arch} cannot resume it: use the same "
                          "arch, or another --train.out_dir")


def _check_resume_record(out: Path, record: dict[str, Any], free: frozenset[str]) -> None:
    saved_path = out / RUN_RECORD
    saved = read_run_record(out)
    if saved is None:
        return
    model_free: frozenset[str] = frozenset()
    if isinstance(record.get("model"), dict):
        arch = record["model"].get("arch", "essh")
        check_same_arch(out, saved, arch)
        if arch in model_configs():                # settings added since the run began, at their old behaviour
            saved["model"] = model_configs()[arch].upgrade_record(saved["model"])
            model_free = model_configs()[arch].RESUME_FREE
    saved["train"] = TrainConfig.upgrade_record(saved["train"])   # an earlier version wrote flat names (lr, ...)
    changed = []
    for section in ("model", "train", "data"):
        if section in record:
            skip = {"train": free, "data": DATA_RESUME_FREE, "model": model_free}[section]
            changed += config_changes(saved[section], record[section], skip, f"{section}.")
    newer = [c.split(":")[0] for c in changed if NOT_SAVED in c]
    if newer:
        raise ConfigError(f"--resume: {out} was written by an older elastic_ssm ({saved_path} has no "
                          f"{', '.join(newer[:4])}{' ...' if len(newer) > 4 else ''}), and this version cannot "
                          "continue its checkpoints; start a new --train.out_dir (each checkpoint's model/ folder "
                          "still loads with from_pretrained)")
    if changed:
        raise ConfigError(f"--resume: {len(changed)} setting(s) that change the objective differ from {saved_path} "
                          f"({'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}); resume with the "
                          "saved settings or start a new --train.out_dir")


def preflight(model: Any, cfg: Any, resume: bool | str, overwrite: bool,
              record: dict[str, Any] | None) -> tuple[RunLock, bool]:
    """Rank-0 checks before the first step; returns the held ``RunLock`` and whether the run resumes
    (``resume="auto"``: when ``out_dir`` holds a complete checkpoint, as for a requeued job)."""
    from .metrics import eval_tier_list, read_log

    out = Path(cfg.out_dir)
    check_output_path("--train.out_dir", str(out), "folder")
    try:
        eval_tier_list(model, cfg.eval.tiers)
    except Exception as e:
        raise ConfigError(f"train.eval.tiers {list(cfg.eval.tiers)}: {e}") from None
    if resume is True and not out.is_dir():
        raise ConfigError(f"--resume: {out} does not exist, so there is no run to continue; run without --resume "
                          "to start one there")
    lock = RunLock(out)
    with lock.undone_on_failure():    # a refused start leaves out as it found it
        if resume == "auto":
            refuse_unusable_run(out)            # damaged checkpoints only: named, never "no checkpoint yet"
            resume = has_checkpoint(out)
            what = "continuing the run" if resume else "no checkpoint yet, starting"
            print(f"[train] --resume auto: {what} in {out}")
        if resume and record is not None:  # every refusal comes before the first change to the directory
            _check_resume_record(out, record, cfg.RESUME_FREE)
        if resume and (out / "metrics.jsonl").is_file():
            read_log(out / "metrics.jsonl")   # the resumed stage rewrites it: a damaged log is named now
        check_free_disk(out, sum(p.numel() for p in model.parameters()))
        claim_run_dir(out, resume, overwrite)
        clean_stale_files(out)
        if record is not None:
            atomic_write_bytes(out / RUN_RECORD, yaml.safe_dump(record, sort_keys=False).encode())
    return lock, bool(resume)


def start_run(model: Any, cfg: Any, ctx: Any, resume: bool | str, overwrite: bool,
              record: dict[str, Any] | None) -> tuple[RunLock | None, bool]:
    """``preflight`` on rank 0 with its verdict broadcast, so that every rank fails (or resumes) together;
    returns the lock (None off rank 0) and whether the run resumes."""
    from .dist import broadcast_object

    lock, failure = None, None
    if ctx.is_main:
        try:
            lock, resume = preflight(model, cfg, resume, overwrite, record)
        except (ConfigError, OSError) as e:
            failure = e
    message, resume = broadcast_object((None if failure is None else str(failure), resume), ctx)
    if failure is not None:
        raise failure
    if message is not None:
        raise ConfigError(f"rank 0 refused to start: {message}")
    return lock, bool(resume)


class StopSignals:
    """While active (``with``), SIGTERM and the first SIGINT set ``requested`` instead of killing the process
    (main thread only; elsewhere a no-op)."""

    def __init__(self, announce: bool = True) -> None:
        self.requested: str | None = None
        self.announce = announce
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = name
        if self.announce:
            print(f"[train] {name}: finishing the current step, then writing a checkpoint and stopping"
                  + (" (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""), flush=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
