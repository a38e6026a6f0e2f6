"""A run directory belongs to one run: a one-writer lock, ownership checks and start-up clean-up.

``train()`` calls these on rank 0 before the first step (``docs/training.md``, "Work is never lost"):

* ``RunLock``: an advisory ``flock`` on ``<out_dir>/.lock`` (held by the open file, so a second open in
  the same process conflicts too). The file holds the holder's host, pid and start time, so a second run
  into the directory is refused with a message naming the holder. The kernel drops the lock when its
  process dies (SIGKILL included), so a lock file left behind is stale by construction; where the file
  system cannot lock, the holder's pid is checked instead (same host).
* ``claim_run_dir``: a fresh run into a directory that holds another run's checkpoints or ``final/`` is
  refused (choices: ``--resume``, ``--overwrite``, another ``--train.out_dir``); ``overwrite`` moves the old
  run aside into a sibling ``<name>.replaced-<UTC time>`` folder (nothing is deleted). ``--resume`` into a
  directory with no checkpoint is refused too.
* ``clean_stale_files``: temporary files of interrupted atomic writes and incomplete (half-written or
  half-pruned) checkpoint directories are removed, each with a warning.
* ``check_free_disk``: enough free space for one more checkpoint (model + AdamW moments, plus margin).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

from ..config import ConfigError
from ..utils.files import is_temp_name

__all__ = ["RunLock", "RunDirBusy", "claim_run_dir", "clean_stale_files", "check_free_disk", "run_artifacts",
           "has_checkpoint", "LOCK_NAME"]

LOCK_NAME = ".lock"
STAGES = ("pretrain", "refine")


class RunDirBusy(ConfigError):
    """Another live process holds the lock of the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Exclusive advisory lock on ``<out_dir>/.lock`` for the lifetime of one run (``with`` or release)."""

    def __init__(self, out_dir: str | Path, owner: str = "run", flag: str = "--train.out_dir") -> None:
        """``owner`` (what holds the lock) and ``flag`` (where the user picks another folder) word the refusal."""
        self.path = Path(out_dir) / LOCK_NAME
        self.owner, self.flag = owner, flag
        self._fd: int | None = None

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        held = self._holder()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                os.close(fd)
                raise RunDirBusy(f"{self.path.parent} is in use by another {self.owner} (pid {held.get('pid', '?')} "
                                 f"on {held.get('host', '?')} since {held.get('started', '?')}); wait for it to "
                                 f"finish or choose another {self.flag}") from None
            # no locking on this file system: fall back to the recorded holder's liveness
            if held.get("host") == socket.gethostname() and held.get("pid") not in (None, os.getpid()) \
                    and _alive(int(held["pid"])):
                os.close(fd)
                raise RunDirBusy(f"{self.path.parent} is in use by pid {held['pid']} (this file system has no "
                                 f"file locks; the pid is alive); choose another {self.flag}") from None
        if held.get("pid") and held.get("pid") != os.getpid():
            if held.get("host") != socket.gethostname() or not _alive(int(held["pid"])):
                warnings.warn(f"{self.path}: taking over the stale lock of pid {held['pid']} on "
                              f"{held.get('host', '?')} (that run ended without releasing it)", stacklevel=2)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the lock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def run_artifacts(out: Path) -> list[str]:
    """Checkpoints and final models of a previous run in ``out`` (relative names, for messages)."""
    found = [f"{s}/{p.name}" for s in STAGES for p in sorted((out / s).glob("step_*")) if p.is_dir()]
    if (out / "final").is_dir():
        found.append("final/")
    return found


def _move_aside(out: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = out.with_name(f"{out.name}.replaced-{stamp}")
    n = 1
    while dest.exists():
        dest, n = out.with_name(f"{out.name}.replaced-{stamp}-{n}"), n + 1
    dest.mkdir(parents=True)
    for child in out.iterdir():
        if child.name != LOCK_NAME:
            os.replace(child, dest / child.name)
    return dest


def has_checkpoint(out: str | Path) -> bool:
    """Whether ``out`` holds a complete checkpoint of a stage (what ``--resume`` needs)."""
    from .checkpoint import _is_complete

    out = Path(out)
    return any(_is_complete(out / name) for name in run_artifacts(out) if name != "final/")


def claim_run_dir(out: str | Path, resume: bool, overwrite: bool) -> Path | None:
    """Check that ``out`` may be written by this run (see the module docstring); returns where an
    ``overwrite`` moved the previous run, else None. Raises ``ConfigError`` with the choices."""
    out = Path(out)
    found = run_artifacts(out)
    if resume:
        if not has_checkpoint(out):
            steps = [f for f in found if "step_" in f]
            held = (f" ({', '.join(steps[:3])} {'is' if len(steps) == 1 else 'are'} incomplete or damaged)"
                    if steps else " (only a final model, which cannot continue training)" if found else "")
            raise ConfigError(f"--resume: {out} holds no complete checkpoint to continue (pretrain/step_* or "
                              f"refine/step_*){held}; run without --resume to start a fresh run there "
                              "(--overwrite if it holds another run)")
        return None
    if not found:
        old_log = out / "metrics.jsonl"
        if old_log.is_file():  # a run that stopped before its first checkpoint: keep its log, start a new one
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(old_log.stat().st_mtime))
            os.replace(old_log, out / f"metrics.prev-{stamp}.jsonl")
        return None
    if not overwrite:
        shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        raise ConfigError(f"{out} already holds another run ({shown}); continue it with --resume, replace it with "
                          "--overwrite (moves it aside), or choose another --train.out_dir")
    dest = _move_aside(out)
    print(f"[train] --overwrite: moved the previous run in {out} to {dest}")
    return dest


def clean_stale_files(out: str | Path) -> list[Path]:
    """Remove temporary files of interrupted writes and incomplete checkpoint directories; returns them."""
    from .checkpoint import _is_complete

    out, removed = Path(out), []
    folders = [out, out / "final", *[out / s for s in STAGES]]
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            stale_tmp = is_temp_name(p.name)
            broken = p.is_dir() and p.name.startswith("step_") and folder.name in STAGES and not _is_complete(p)
            if stale_tmp or broken:
                what = "temporary file of an interrupted write" if stale_tmp else "incomplete checkpoint"
                warnings.warn(f"removing {p} ({what})", stacklevel=2)
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def check_free_disk(out: str | Path, n_params: int, margin: float = 1.25) -> None:
    """Raise ``OSError(ENOSPC)`` when ``out`` lacks room for one checkpoint: fp32 weights and two AdamW
    moments (12 bytes per parameter) times ``margin``."""
    need = int(12 * n_params * margin)
    free = shutil.disk_usage(out).free
    if free < need:
        raise OSError(errno.ENOSPC, f"{out} has {free / 2**20:.1f} MiB free but one checkpoint of this "
                                    f"model needs about {need / 2**20:.1f} MiB; free space or choose another "
                                    "--train.out_dir")
