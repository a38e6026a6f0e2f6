"""Kind ``replication_state``: the state folder carried between device calls (``pack`` into ``$OUT`` as parts of
at most 16 MiB, ``restore`` from the carried folder unless the machine holds that generation already, ``wait`` for
the concurrent steps) and the runs' committed records (``pack_records``, ``seed_records``). See the package
docstring.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Gt, Interval

from elastic_ssm.config import ConfigBase, ConfigError, opt

from .steps import TRITON_DIR, wait_concurrent

__all__ = ["ReplicationStateOptions", "run_state", "pack_state", "restore_state", "pack_records", "seed_records",
           "STATE_NAME", "RECORDS_NAME", "RECORD_FILES"]

STATE_NAME = "replication-state"
RECORDS_NAME = "replication-records.tgz"
#: the files of a run that its claim's report reads (claims.py; channel_importance.*: replication-evals), besides
#: ``logs/*.log``
RECORD_FILES = ("eval.csv", "metrics.jsonl", "parameters.json", "run.yaml", "calls.jsonl", "channel_importance.csv",
                "channel_importance.json")
_HEAVY_DIRS = {"final", "exports"}


@dataclass(kw_only=True)
class ReplicationStateOptions(ConfigBase):
    """Restore the carried state at the start of a call, or pack it for the next call at its end."""

    action: Literal["restore", "wait", "pack"] = opt(
        "pack", "'restore' (first entry of a suite), 'wait' (for the concurrent steps started so far, before steps "
                "that need their outputs) or 'pack' (last entry)")
    root: str = opt("runs/replication", "the state folder")
    carry: str = opt("runs/carry", "restore: the carried folder holding replication-state.json and its parts")
    records: str = opt("docs/results/records", "restore: committed run records added where the state lacks them "
                                               "('' : none)")
    dest: str = opt("$OUT", "pack: where the state goes (environment variables expanded; when that is unset, "
                            "<root>/../carry-out)")
    max_mib: Annotated[float, Gt(0)] = opt(44.0, "pack: the state's size limit (a checkpoint is included only "
                                                 "below it)")
    part_mib: Annotated[float, Interval(gt=0, le=16)] = opt(15.0, "pack: the largest part file (a device call "
                                                                  "returns files of at most 16 MiB)")
    publish: tuple[str, ...] = opt((), "pack: files under root copied beside the state (e.g. results/claim1.json)")



def _light_files(root: Path) -> list[Path]:
    """Every file of the state but model weights (``final/``, ``exports/``) and checkpoint directories; of the
    steps' Triton cache only the autotuning results (``*.autotune.json``, a few KB each: a later call then
    compiles each kernel's chosen config once instead of benchmarking every config again)."""
    out = sorted((root / TRITON_DIR).rglob("*.autotune.json"))
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts
        if not p.is_file() or any(d in _HEAVY_DIRS or d.startswith("step_") or d.startswith(".") for d in rel[:-1]):
            continue
        if rel[-1] in (".lock", "latest") or rel[-1].startswith(STATE_NAME):
            continue
        out.append(p)
    return out


def _newest_checkpoints(root: Path) -> list[Path]:
    """The newest complete checkpoint directory of each unfinished run (a run without ``final/``)."""
    out = []
    for run in sorted(d for d in root.iterdir() if d.is_dir()):
        if (run / "final").is_dir():
            continue
        for stage in sorted(d for d in run.iterdir() if d.is_dir()):
            steps = sorted(s for s in stage.glob("step_*") if (s / "COMPLETE.json").is_file())
            if steps:
                out.append(steps[-1])
    return out


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def pack_state(root: str | Path, dest: str | Path, max_mib: float = 44.0, part_mib: float = 15.0) -> dict:
    """Write ``root`` as ``replication-state.tgz.partNN`` + ``replication-state.json`` into ``dest``."""
    root, dest = Path(root), Path(dest)
    state_file = root / f"{STATE_NAME}.json"
    generation = json.loads(state_file.read_text())["generation"] + 1 if state_file.is_file() else 1
    files = _light_files(root)
    budget = int(max_mib * 2**20) - sum(f.stat().st_size for f in files)
    kept, left_out = [], []
    # the most recently written first: the runs this call advanced, not an old probe's leftover (mtimes survive
    # the tar round trip of restore_state)
    newest_first = sorted(_newest_checkpoints(root), key=lambda c: (c / "COMPLETE.json").stat().st_mtime,
                          reverse=True)
    for ckpt in newest_first:
        size = _size(ckpt)
        if size <= budget:                    # weights compress little: count them at full size
            kept.append(str(ckpt.relative_to(root)))
            budget -= size
            files += [f for f in sorted(ckpt.rglob("*")) if f.is_file()]
        else:
            left_out.append(str(ckpt.relative_to(root)))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(root)))
    blob, part = buf.getvalue(), int(part_mib * 2**20)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{STATE_NAME}.tgz.part*"):
        old.unlink()
    parts = []
    for i in range(0, max(len(blob), 1), part):
        name = f"{STATE_NAME}.tgz.part{len(parts):02d}"
        (dest / name).write_bytes(blob[i:i + part])
        parts.append({"name": name, "sha256": hashlib.sha256(blob[i:i + part]).hexdigest()})
    meta = {"generation": generation, "parts": parts, "bytes": len(blob), "files": len(files),
            "checkpoints": kept, "checkpoints_left_out": left_out,
            "runs": sorted(d.name for d in root.iterdir() if d.is_dir()), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    state_file.write_text(json.dumps({"generation": generation}) + "\n")
    (dest / f"{STATE_NAME}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _record_files(root: Path) -> list[Path]:
    """Each run's records under ``root``: ``<run>/<RECORD_FILES>`` and ``<run>/logs/*.log``, and the steps'
    Triton autotuning results (``.triton/**/*.autotune.json``: committed with the records, a new machine of the
    same image compiles each fla kernel's chosen config once instead of benchmarking every config; on the H200
    that was 274 s of a 40m run's start-up against 63 s, docs/results.md)."""
    out = sorted((root / TRITON_DIR).rglob("*.autotune.json"))
    for run in sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")):
        out += [run / n for n in RECORD_FILES if (run / n).is_file()]
        out += sorted(p for p in (run / "logs").glob("*.log") if p.is_file())
    return out


def pack_records(root: str | Path, dest: str | Path) -> dict:
    """Write every run's records (text, no weights) as ``dest/replication-records.tgz``."""
    root, dest = Path(root), Path(dest)
    files = _record_files(root) if root.is_dir() else []
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest / RECORDS_NAME, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(root)))
    return {"files": len(files), "bytes": (dest / RECORDS_NAME).stat().st_size}


def seed_records(records: str | Path, root: str | Path) -> list[str]:
    """Copy the committed records under ``records`` (``<run>/...``, as ``pack_records`` wrote them) into ``root``
    where ``root`` lacks the file; returns the runs that got files. A file already in ``root`` (a newer carried
    state) is never replaced."""
    records, root = Path(records), Path(root)
    runs = set()
    if not records.is_dir():
        return []
    for src in sorted(p for p in records.rglob("*") if p.is_file()):
        dst = root / src.relative_to(records)
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            top = src.relative_to(records).parts[0]
            if not top.startswith("."):                  # .triton: autotuning results, not a run
                runs.add(top)
    return sorted(runs)


def restore_state(carry: str | Path, root: str | Path) -> str:
    """Unpack the carried state into ``root`` unless ``root`` holds that generation already; returns what
    happened. A part that does not match its recorded sha256 is a one-line error."""
    carry, root = Path(carry), Path(root)
    meta_file = carry / f"{STATE_NAME}.json"
    if not meta_file.is_file():
        return f"nothing carried ({meta_file} absent): a first call"
    fix = f"copy every file of the last call's $OUT into {carry}"
    try:
        meta = json.loads(meta_file.read_text())
        parts, generation = list(meta["parts"]), int(meta["generation"])
        names = [(p["name"], p["sha256"]) for p in parts]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"carried state {meta_file} is not a state written by pack ({type(err).__name__}: "
                          f"{err}); {fix}") from None
    here = root / f"{STATE_NAME}.json"
    have = json.loads(here.read_text())["generation"] if here.is_file() else 0
    if have >= generation:
        return f"kept the machine's state (generation {have} >= carried {generation})"
    blob = b""
    for name, digest in names:
        data = (carry / name).read_bytes() if (carry / name).is_file() else b""
        if hashlib.sha256(data).hexdigest() != digest:
            raise ConfigError(f"carried state part {carry / name} is missing or differs from {meta_file}; {fix}")
        blob += data
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(root, **kw)
    here.write_text(json.dumps({"generation": generation}) + "\n")
    return f"restored generation {generation}: {meta.get('files')} files, checkpoints {meta.get('checkpoints')}"


def run_state(opts: ReplicationStateOptions, ctx) -> list[dict]:
    waited = wait_concurrent(ctx.log)
    if opts.action == "wait":
        return [{"action": "wait", "waited_for": waited}]
    if opts.action == "restore":
        what = restore_state(opts.carry, opts.root)
        seeded = seed_records(opts.records, opts.root) if opts.records else []
        if seeded:
            what += f"; records of {', '.join(seeded)} added from {opts.records}"
        ctx.log(f"  {what}")
        return [{"action": "restore", "result": what}]
    dest = os.path.expandvars(opts.dest)
    if "$" in dest or not dest:
        dest = str(Path(opts.root).parent / "carry-out")
    meta = pack_state(opts.root, dest, opts.max_mib, opts.part_mib)
    records = pack_records(opts.root, dest)
    for rel in opts.publish:
        src = Path(opts.root) / rel
        if src.is_file():
            shutil.copy2(src, Path(dest) / src.name)
    ctx.log(f"  packed generation {meta['generation']} into {dest}: {meta['files']} files, {meta['bytes']:,} bytes "
            f"in {len(meta['parts'])} part(s), checkpoints {meta['checkpoints']}; records: {records['files']} files, "
            f"{records['bytes']:,} bytes ({RECORDS_NAME}: unpack into docs/results/records/ and commit)")
    if meta["checkpoints_left_out"]:
        ctx.log(f"  WARNING: over max_mib={opts.max_mib:g}, these checkpoints stay behind and their runs start over: "
                f"{meta['checkpoints_left_out']}")
    return [{"action": "pack", "dest": dest, **{k: meta[k] for k in ("generation", "files", "bytes", "checkpoints")}}]
