"""A run directory belongs to one run: the one-writer lock (``RunLock``), ownership (``claim_run_dir``), start-up
clean-up (``clean_stale_files``) and free disk (``check_free_disk``); docs/training.md, "Work is never lost", says
what each refuses, moves aside or removes. ``train()`` calls them on rank 0 before the first step."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.base import read_yaml_file
from ..utils.files import atomic_write_bytes, free_stamped_path, is_temp_name, read_json
from .checkpoint import COMPLETE, LATEST, checkpoint_dirs, checkpoint_fault, move_damaged, step_of

__all__ = ["RunLock", "RunDirBusy", "claim_run_dir", "clean_stale_files", "check_free_disk", "run_artifacts",
           "has_checkpoint", "refuse_unusable_run", "read_run_record", "LOCK_NAME", "RUN_RECORD"]

LOCK_NAME = ".lock"
RUN_RECORD = "run.yaml"
STAGES = ("pretrain", "refine")
#: files ``train`` writes at the top of its directory through atomic writes (their temporaries are its own)
OWN_FILES = ("run.yaml", "metrics.jsonl", "parameters.json")
#: ``train`` settings every run record (``run.yaml`` as ``train`` writes it) holds
_RECORD_TRAIN_KEYS = frozenset({"recipe", "steps", "seq_len", "optim", "checkpoint", "out_dir", "seed"})


class RunDirBusy(ConfigError):
    """Another live process holds the lock of the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, owned by another user
        pass
    return True


class RunLock:
    """Exclusive advisory lock on ``<out_dir>/.lock`` for the lifetime of one run (``with`` or release)."""

    def __init__(self, out_dir: str | Path, owner: str = "run", flag: str = "--train.out_dir",
                 name: str = LOCK_NAME) -> None:
        """``owner`` (what holds the lock) and ``flag`` (where the user picks another folder) word the refusal;
        ``name`` is the lock file's (``prepare`` locks one output file: ``.<out name>.lock`` beside it)."""
        self.path = Path(out_dir) / name
        self.owner, self.flag = owner, flag
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        held = read_json(self.path) or {}      # the holder's record: host, pid, start time
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
        if held.get("pid") and held["pid"] != os.getpid() and (held.get("host") != socket.gethostname()
                                                               or not _alive(int(held["pid"]))):
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
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor drops the lock
        self._fd = None

    @contextlib.contextmanager
    def undone_on_failure(self, remove: bool = False):
        """Hold the lock for the block; if the block fails, the disk is left as found: the lock file when acquiring
        created it (removed while still held: no other run can have locked it in between) and, each only when
        empty, the folders it created. ``remove``: the lock file goes and the lock is released at the end either
        way (a one-off writer such as ``prepare``); else a lock that succeeded stays held."""
        made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]    # deepest first
        had_lock = self.path.exists()
        self.acquire()
        ok = False
        try:
            yield self
            ok = True
        finally:
            if remove or not ok:
                if not had_lock:
                    self.path.unlink(missing_ok=True)
                self.release()
            for folder in [] if ok else made:
                try:
                    folder.rmdir()
                except OSError:
                    break

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def run_artifacts(out: Path) -> list[str]:
    """What a previous run left in ``out`` (checkpoints, final model, damaged checkpoints), for messages."""
    return ([f"{s}/{p.name}" for s in STAGES for p in sorted((out / s).glob("step_*")) if p.is_dir()]
            + [f"{name}/" for name in ("final", "damaged") if (out / name).is_dir()])


def has_checkpoint(out: str | Path) -> bool:
    """Whether ``out`` holds a complete checkpoint of a stage (what ``--resume`` needs)."""
    return any(checkpoint_fault(p) is None for s in STAGES for p in checkpoint_dirs(Path(out) / s))


def _unusable_only(out: Path) -> str | None:
    """When every checkpoint of ``out`` fails its check and there is no final model: what is wrong with the
    newest one (for the refusal), else None."""
    if has_checkpoint(out) or (out / "final").is_dir():
        return None
    bad = [(f"{s}/{p.name}", checkpoint_fault(p)) for s in STAGES for p in checkpoint_dirs(out / s)]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more checkpoint(s) failed too)" if len(bad) > 1 else ""
    return f"{bad[0][0]} is incomplete or damaged: {bad[0][1]}{more}"


def refuse_unusable_run(out: str | Path) -> None:
    """Raise ``ConfigError`` when ``out`` holds checkpoints that all fail their check and no final model: there
    is nothing to continue, yet starting over would bury that run (``--resume auto``, a fresh run)."""
    out = Path(out)
    bad = _unusable_only(out) if out.is_dir() else None
    if bad is not None:
        raise ConfigError(f"{out} holds a run whose checkpoints all fail their check ({bad}); nothing was "
                          "changed: restore that file from a copy and continue with --resume, start the run "
                          "over with --overwrite (moves it aside), or choose another --train.out_dir")


def read_run_record(out: str | Path) -> dict[str, Any] | None:
    """The ``run.yaml`` of ``out`` (None when there is none); a damaged one (not YAML, not a mapping of ``model``,
    ``train`` and ``data`` mappings) is a ``ConfigError``: a resume is compared against it."""
    path = Path(out) / RUN_RECORD
    if not path.is_file():
        return None
    fix = "restore it from a copy, or start a new --train.out_dir"
    try:
        saved = read_yaml_file(path, "run record")
    except ConfigError as e:
        raise ConfigError(f"{e}; {fix}") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in ("model", "train", "data")):
        raise ConfigError(f"{path} is not a run record (a mapping with model, train and data sections); {fix}")
    return saved


#: how ``_would_overwrite`` names a saved model's files (an export, a model folder: not a run)
MODEL_FILES = "a saved model (config.json / model.safetensors)"


def _would_overwrite(out: Path) -> list[str]:
    """Entries of ``out`` (holding no checkpoint or final model) that a new run would overwrite or trip on."""
    clash = [MODEL_FILES] if any((out / n).exists() for n in ("config.json", "model.safetensors")) else []
    run_yaml = out / "run.yaml"
    try:                              # a run.yaml that train wrote (an earlier attempt: kept, not a clash)
        rec = read_run_record(out)
        earlier = rec is not None and _RECORD_TRAIN_KEYS <= set(rec["train"])
    except (ConfigError, OSError):
        earlier = False
    if run_yaml.exists() and not earlier:
        clash.append("run.yaml (not a run record written by train)")
    if (out / "parameters.json").exists() and not (earlier and (out / "parameters.json").is_file()):
        clash.append("parameters.json")
    if (out / "metrics.jsonl").exists() and not (out / "metrics.jsonl").is_file():
        clash.append("metrics.jsonl (not a file)")
    clash += [f"{name} (not a folder)" for name in (*STAGES, "final") if (out / name).exists()
              and not (out / name).is_dir()]
    return clash


def _keep_earlier_attempt(out: Path) -> None:
    """An earlier attempt without checkpoints: its log, record and parameter report stay, dated, beside the new
    run's."""
    old_log, old_rec = out / "metrics.jsonl", out / "run.yaml"
    dated = old_log if old_log.is_file() else old_rec
    if not dated.is_file():
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(dated.stat().st_mtime))
    for path, dest in ((old_log, f"metrics.prev-{stamp}.jsonl"), (old_rec, f"run.prev-{stamp}.yaml"),
                       (out / "parameters.json", f"parameters.prev-{stamp}.json")):
        if path.is_file() and not (out / dest).exists():
            os.replace(path, out / dest)


def claim_run_dir(out: str | Path, resume: bool, overwrite: bool) -> Path | None:
    """Check that ``out`` may be written by this run (see the module docstring); returns where an
    ``overwrite`` moved the previous run, else None. Raises ``ConfigError`` with the choices."""
    out = Path(out)
    found = run_artifacts(out)
    if resume:
        if not has_checkpoint(out):
            bad = _unusable_only(out)
            if bad is not None:
                raise ConfigError(f"--resume: {out} holds no complete checkpoint to continue ({bad}); restore that "
                                  "file from a copy and resume again, or start the run over with --overwrite "
                                  "instead of --resume (moves this run aside; nothing is deleted)")
            steps = [f for f in found if "step_" in f]
            held = (f" ({', '.join(steps[:3])} {'is' if len(steps) == 1 else 'are'} incomplete or damaged)"
                    if steps else " (only a final model, which cannot continue training)" if "final/" in found
                    else f" (checkpoints that failed their check were moved to {out / 'damaged'})" if found else "")
            raise ConfigError(f"--resume: {out} holds no complete checkpoint to continue (pretrain/step_* or "
                              f"refine/step_*){held}; run without --resume to start a fresh run there "
                              "(--overwrite if it holds another run)")
        return None
    clash = [] if found else _would_overwrite(out)
    if not found and not clash:
        _keep_earlier_attempt(out)
        return None
    if not overwrite:
        refuse_unusable_run(out)   # e.g. --resume auto: nothing to continue, yet not an empty folder either
        if MODEL_FILES in clash:
            raise ConfigError(f"{out} holds a saved model (config.json / model.safetensors): a run trained there "
                              f"writes its model to {out / 'final'}, and eval, generate and from_pretrained on {out} "
                              "would still load the old one; choose another --train.out_dir, or pass --overwrite "
                              "(moves the folder's contents aside, nothing is deleted)")
        if clash:
            raise ConfigError(f"{out} holds files a new run would overwrite ({', '.join(clash)}); move them away, "
                              "pass --overwrite (moves the folder's contents aside, nothing is deleted), or choose "
                              "another --train.out_dir")
        shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        raise ConfigError(f"{out} already holds another run ({shown}); continue it with --resume, replace it with "
                          "--overwrite (moves it aside), or choose another --train.out_dir")
    dest = free_stamped_path(out.parent, f"{out.name}.replaced-")
    dest.mkdir(parents=True)
    for child in out.iterdir():
        if child.name != LOCK_NAME:           # this run holds it
            os.replace(child, dest / child.name)
    print(f"[train] --overwrite: moved the previous {'run' if found else 'files'} in {out} to {dest}")
    return dest


def clean_stale_files(out: str | Path) -> list[Path]:
    """Remove temporary files of interrupted writes and unmarked checkpoint directories older than a
    complete one (a prune cut short); move every other checkpoint directory that fails its check into
    ``<out>/damaged/<stage>/`` (never deleted). Returns the paths removed or moved."""
    out, removed = Path(out), []
    folders = [out, out / "final", *[out / s for s in STAGES]]
    for folder in (f for f in folders if f.is_dir()):
        for p in folder.iterdir():    # at the top of out (a folder the user may share): only OWN_FILES' temporaries
            if is_temp_name(p.name) and (folder != out or any(p.name.startswith(f".{f}.") for f in OWN_FILES)):
                warnings.warn(f"removing {p} (temporary file of an interrupted write)", stacklevel=2)
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    for s in STAGES:
        dirs = checkpoint_dirs(out / s)
        faults = {p: checkpoint_fault(p) for p in dirs}
        good = [p for p in dirs if faults[p] is None]
        for p in (p for p in dirs if faults[p] is not None):
            removed.append(p)
            if p.is_dir() and not (p / COMPLETE).exists() and good and step_of(p) < step_of(good[0]):
                warnings.warn(f"removing {p} (an old checkpoint whose deletion was cut short)", stacklevel=2)
                shutil.rmtree(p, ignore_errors=True)
                continue
            dest = move_damaged(p)
            then = (f"training resumes from the newest good checkpoint, {s}/{good[0].name}" if good
                    else f"no good checkpoint of {s} is left")
            print(f"[train] checkpoint {s}/{p.name} failed its check ({faults[p]}); moved it to {dest}, nothing "
                  f"was deleted; {then}", flush=True)
        pointer = out / s / LATEST
        if pointer.is_dir():                   # the pointer is a one-line file; a folder there is moved, not lost
            removed.append(pointer)
            print(f"[train] {pointer} is a folder, not the pointer file; moved it to {move_damaged(pointer)}")
        if dirs and pointer.is_file() and not (out / s / pointer.read_text().strip()).is_dir():
            atomic_write_bytes(pointer, good[0].name.encode()) if good else pointer.unlink()
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
