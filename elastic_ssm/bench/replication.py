"""Entry kinds of the replication suites (issue 16, ``configs/bench/replication-*.yaml``): runs that span
short device calls.

A device call lasts at most 10 minutes and starts on a bare machine; only up to 8 files (16 MiB each) come
back from ``$OUT``, and the next call gets back what the caller carries. The suites therefore keep every run
under one state folder, ``root`` (default ``runs/replication``, one sub-folder per run: ``essh``,
``dense``, ...), and three kinds move it through calls:

=====================  ======================================================================================
``replication_step``   one command of a run (``elastic-ssm train ... --resume auto``, ``eval``, ``recover``):
                       skipped when its ``outputs`` (or everything in ``skip_when``) exist, ``waiting`` while a
                       path of ``requires`` is missing, ``deferred`` when less than ``needs_s`` of the suite's
                       budget is left (or, for a run starting over because its checkpoint did not travel, less
                       than a cut fresh attempt of it ran plus ``grace_s``: it needs more than it had); a
                       command still running ``grace_s`` before the budget ends gets SIGTERM
                       (``elastic-ssm train`` then writes a checkpoint and exits 143) and SIGKILL at the end.
                       Output is appended to ``<run>/logs/<entry>.log``, one JSON line per call (state, rc,
                       seconds, whether a checkpoint existed at the start, device, commit) to
                       ``<run>/calls.jsonl``; with ``once`` a step that ran to completion in an earlier call
                       is skipped although its outputs (model weights) did not travel (the calibration probes).
                       With ``concurrent`` the command starts and the suite goes on at once (a thread supervises
                       it), so two small runs share the GPU; the next ``replication_report`` or
                       ``replication_state`` entry first waits for every such step (``wait_concurrent``).
``replication_state``  ``action: wait`` waits for the concurrent steps started so far (a later step needs their
                       outputs); ``action: restore`` unpacks the state carried from the last call (``carry``
                       folder) into ``root`` unless the machine still holds that generation or a newer one, then
                       adds the committed records (``records``, below) of runs the state lacks; ``action: pack``
                       writes ``root`` as ``replication-state.tgz.partNN`` (at most ``part_mib`` each) plus
                       ``replication-state.json`` into ``dest`` (``$OUT``), leaving out model weights and
                       checkpoints except the newest checkpoint of an unfinished run when the whole state
                       stays under ``max_mib``; and copies the files named in ``publish`` beside them. The
                       steps' ``TRITON_CACHE_DIR`` is ``<root>/.triton``: its autotuning results travel too,
                       so fla's kernels are benchmarked once per shape over all calls, not once per call.
                       Pack also writes ``replication-records.tgz``: each run's records (``RECORD_FILES`` and its
                       logs, text, what the reports read) and the Triton autotuning results (``.triton``), to be
                       unpacked into ``docs/results/records/`` and
                       committed, so a finished run survives the loss of the carried state (the carry lives on
                       one development machine; committed records live in the repository).
``replication_report`` the per-tier numbers of every run of one claim into ``<root>/results/claimN.json`` and
                       its plot ``claimN.png`` (``eval/replication.py``).
=====================  ======================================================================================

In the command of a step ``{root}`` is the state folder, ``{run}`` the run's folder (``<root>/<run>``) and
``python`` this interpreter.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigBase, ConfigError, opt

__all__ = ["ReplicationStepOptions", "ReplicationStateOptions", "ReplicationReportOptions", "run_step",
           "wait_concurrent", "run_state", "run_report", "pack_state", "restore_state", "pack_records", "seed_records",
           "STATE_NAME", "RECORDS_NAME", "RECORD_FILES"]

STATE_NAME = "replication-state"
RECORDS_NAME = "replication-records.tgz"
#: the files of a run that its claim's report reads (eval/replication.py), besides ``logs/*.log``
RECORD_FILES = ("eval.csv", "metrics.jsonl", "parameters.json", "run.yaml", "calls.jsonl")
_HEAVY_DIRS = {"final", "exports"}
TRITON_DIR = ".triton"     # under root: the steps' TRITON_CACHE_DIR; only its *.autotune.json files travel


def _fill(text: str, root: Path, run: str) -> str:
    return text.replace("{root}", str(root)).replace("{run}", str(root / run) if run else str(root))


def _all_exist(paths, root: Path, run: str) -> bool:
    return bool(paths) and all(Path(_fill(p, root, run)).exists() for p in paths)


def _has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("*/step_*/COMPLETE.json"))


def _recorded_ran(run_dir: Path, step: str) -> bool:
    """Whether ``<run>/calls.jsonl`` holds a call of ``step`` that ran to completion."""
    from ..eval.replication import read_jsonl

    return any(rec.get("step") == step and rec.get("state") == "ran" for rec in read_jsonl(run_dir / "calls.jsonl"))


def _cut_after(run_dir: Path, step: str) -> float:
    """Seconds the longest fresh attempt of ``step`` ran before the budget stopped it (0: none was cut)."""
    from ..eval.replication import read_jsonl

    return max((float(rec.get("wall_s", 0.0)) for rec in read_jsonl(run_dir / "calls.jsonl")
                if rec.get("step") == step and rec.get("state") == "stopped" and rec.get("fresh")), default=0.0)


def _environment() -> dict:
    import torch

    from ..utils.environment import environment

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(dev)
    return {k: env[k] for k in ("device", "torch", "cuda", "triton", "fla", "python", "commit", "date")}


@dataclass(kw_only=True)
class ReplicationStepOptions(ConfigBase):
    """One command of a replication run, resumable across device calls (see the module docstring)."""

    args: tuple[str, ...] = opt((), "the command; {root}, {run} and 'python' are filled in")
    extra_args: tuple[str, ...] = opt((), "appended to args (e.g. --bench.set essh-train.extra_args=[--stop_after,20])")
    run: str = opt("", "the run's folder under root (its log, calls.jsonl and {run})")
    root: str = opt("runs/replication", "the state folder every run of the suites lives in")
    outputs: tuple[str, ...] = opt((), "paths this step produces; the step is skipped when all exist")
    skip_when: tuple[str, ...] = opt((), "also skipped when all of these exist (the results of the steps that "
                                         "need this one's outputs)")
    once: bool = opt(False, "also skipped when the run's calls.jsonl records this step as ran (for steps whose "
                            "outputs do not travel between calls and that nothing else needs, e.g. probes)")
    requires: tuple[str, ...] = opt((), "paths that must exist before the step runs (else: waiting)")
    needs_s: float = opt(0.0, "start only with at least this many seconds of the suite's budget left")
    timeout_s: float = opt(0.0, "stop the command after this many seconds (0: the suite's remaining budget)")
    grace_s: float = opt(45.0, "SIGTERM this long before the stop, SIGKILL at the stop (time for a checkpoint)")
    reserve_s: float = opt(25.0, "stop this long before the suite's budget ends (the pack entry runs after it)")
    concurrent: bool = opt(False, "start the command and go on to the next entries at once; the next report or "
                                  "pack entry waits for it (two small runs sharing one GPU: claim 3's MQAR arms)")

    def validate(self) -> None:
        if not self.args:
            raise ConfigError("ReplicationStepOptions.args: give the command, e.g. [python, -m, elastic_ssm.cli, "
                              "train, ...]")
        if min(self.grace_s, self.needs_s, self.timeout_s, self.reserve_s) < 0:
            raise ConfigError("ReplicationStepOptions: needs_s, timeout_s, grace_s and reserve_s must be >= 0")


def _supervise(cmd: list[str], env: dict, log_path: Path, stop_at: float, grace_s: float) -> tuple[object, bool]:
    """Run ``cmd`` with output appended to ``log_path``; SIGTERM at ``stop_at - grace_s``, SIGKILL (the whole
    process group) at ``stop_at``. Returns ``(rc or 'killed', whether SIGTERM was sent)``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        termed = False
        while p.poll() is None:
            now = time.monotonic()
            if now >= stop_at:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return "killed", True
            if not termed and now >= stop_at - grace_s:
                p.send_signal(signal.SIGTERM)
                termed = True
            time.sleep(0.2)
    return p.returncode, termed


def run_step(opts: ReplicationStepOptions, ctx) -> list[dict]:
    root = Path(opts.root)
    run_dir = root / opts.run if opts.run else root
    row: dict = {"run": opts.run, "step": ctx.name}
    if (_all_exist(opts.outputs, root, opts.run) or _all_exist(opts.skip_when, root, opts.run)
            or (opts.once and _recorded_ran(run_dir, ctx.name))):
        ctx.log(f"  {ctx.name}: done earlier, skipped")
        return [{**row, "state": "skipped"}]
    missing = [p for p in opts.requires if not Path(_fill(p, root, opts.run)).exists()]
    if missing:
        ctx.log(f"  {ctx.name}: waiting for {_fill(missing[0], root, opts.run)}")
        return [{**row, "state": "waiting", "missing": _fill(missing[0], root, opts.run)}]
    left = ctx.time_left() - opts.reserve_s
    fresh = not _has_checkpoint(run_dir)
    cut = _cut_after(run_dir, ctx.name) if fresh else 0.0      # its checkpoint did not travel: it starts over
    needs = max(opts.needs_s, cut + opts.grace_s if cut else 0.0, 1.0)
    if left < needs:
        why = f"; a fresh attempt was stopped after {cut:.0f} s" if needs > max(opts.needs_s, 1.0) else ""
        ctx.log(f"  {ctx.name}: deferred ({left:.0f} s left of the budget, needs {needs:.0f} s{why})")
        return [{**row, "state": "deferred"}]
    stop_at = time.monotonic() + min(opts.timeout_s or float("inf"), left)
    cmd = [sys.executable if a == "python" else _fill(a, root, opts.run) for a in opts.args + opts.extra_args]
    env = ctx.child_env()
    env.setdefault("TRITON_CACHE_DIR", str((root / TRITON_DIR).resolve()))   # autotuning carried (pack_state)
    launch = lambda: _execute(opts, ctx, row, cmd, env, stop_at, fresh)     # noqa: E731
    if not opts.concurrent:
        return [launch()]
    started = {**row, "state": "started"}

    def supervised() -> None:
        try:
            started.update(launch())
        except Exception as err:  # recorded in the row, never lost in a thread
            started.update(state=f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            ctx.log(f"  {ctx.name}: {started['state']}")

    thread = threading.Thread(target=supervised, name=ctx.name, daemon=True)
    thread.start()
    _CONCURRENT.append(thread)
    ctx.log(f"  {ctx.name}: started alongside the next entries (the next report or pack entry waits for it)")
    return [started]


#: concurrent steps started by this process and not yet waited for (``wait_concurrent``)
_CONCURRENT: list[threading.Thread] = []


def wait_concurrent(log=None) -> int:
    """Wait for every concurrent step started so far; each ends by its own SIGTERM/SIGKILL deadline, so this
    returns before the suite's budget. The report and pack entries call it first. Returns how many it waited for."""
    n = 0
    while _CONCURRENT:
        thread = _CONCURRENT.pop(0)
        if log and thread.is_alive():
            log(f"  waiting for {thread.name}")
        thread.join()
        n += 1
    return n


def _execute(opts: ReplicationStepOptions, ctx, row: dict, cmd: list[str], env: dict, stop_at: float,
             fresh: bool) -> dict:
    """Run one step's command under ``_supervise`` and record the call in ``<run>/calls.jsonl``."""
    root = Path(opts.root)
    run_dir = root / opts.run if opts.run else root
    t0 = time.monotonic()
    rc, termed = _supervise(cmd, env, run_dir / "logs" / f"{ctx.name}.log", stop_at, opts.grace_s)
    wall = round(time.monotonic() - t0, 1)
    complete = not opts.outputs or _all_exist(opts.outputs, root, opts.run)
    state = ("ran" if rc == 0 and complete else "stopped" if termed
             else "incomplete" if rc == 0 else f"failed rc={rc}")
    rec = {**row, "state": state, "rc": rc, "wall_s": wall, "fresh": fresh, "checkpoint": _has_checkpoint(run_dir),
           **_environment()}
    with open(run_dir / "calls.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    tail = (run_dir / "logs" / f"{ctx.name}.log").read_text(errors="replace").strip().splitlines()[-1:]
    ctx.log(f"  {ctx.name}: {state} in {wall} s{': ' + tail[0][-200:] if tail and state != 'ran' else ''}")
    return rec


# ---- carrying the state between calls ---------------------------------------------------------------------
@dataclass(kw_only=True)
class ReplicationStateOptions(ConfigBase):
    """Restore the carried state at the start of a call, or pack it for the next call at its end."""

    action: str = opt("pack", "'restore' (first entry of a suite), 'wait' (for the concurrent steps started so far, "
                              "before steps that need their outputs) or 'pack' (last entry)")
    root: str = opt("runs/replication", "the state folder")
    carry: str = opt("runs/carry", "restore: the carried folder holding replication-state.json and its parts")
    records: str = opt("docs/results/records", "restore: committed run records added where the state lacks them "
                                               "('' : none)")
    dest: str = opt("$OUT", "pack: where the state goes (environment variables expanded; when that is unset, "
                            "<root>/../carry-out)")
    max_mib: float = opt(44.0, "pack: the state's size limit (a checkpoint is included only below it)")
    part_mib: float = opt(15.0, "pack: the largest part file (a device call returns files of at most 16 MiB)")
    publish: tuple[str, ...] = opt((), "pack: files under root copied beside the state (e.g. results/claim1.json)")

    def validate(self) -> None:
        if self.action not in ("restore", "pack", "wait"):
            raise ConfigError(f"ReplicationStateOptions.action must be 'restore', 'wait' or 'pack', got "
                              f"{self.action!r}")
        if not 0 < self.part_mib <= 16 or self.max_mib <= 0:
            raise ConfigError("ReplicationStateOptions: part_mib must be in (0, 16] and max_mib > 0")


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


# ---- the claim's table and plot ---------------------------------------------------------------------------
@dataclass(kw_only=True)
class ReplicationReportOptions(ConfigBase):
    """Collect one claim's numbers from its runs into ``<root>/results/claimN.json`` and draw ``claimN.png``."""

    claim: int = opt(1, "the claim of issue 16 (1-5; 0: the calibration runs)")
    root: str = opt("runs/replication", "the state folder")
    runs: tuple[str, ...] = opt((), "the runs (folders under root) of the claim; a missing one is listed as to-run")

    def validate(self) -> None:
        if not 0 <= self.claim <= 5:
            raise ConfigError(f"ReplicationReportOptions.claim must be 0-5, got {self.claim}")
        if not self.runs:
            raise ConfigError("ReplicationReportOptions.runs: name the claim's runs, e.g. [essh, dense]")


def run_report(opts: ReplicationReportOptions, ctx) -> list[dict]:
    from ..eval.replication import collect_claim
    from ..eval.replication_plot import plot_claim

    wait_concurrent(ctx.log)
    res = collect_claim(opts.claim, opts.root, opts.runs)
    out = Path(opts.root) / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = f"claim{opts.claim}" if opts.claim else "calibration"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    skipped = plot_claim(res, out / f"{name}.png")
    ctx.log(f"  wrote {out / (name + '.json')}" + (f"; plot skipped: {skipped}" if skipped else f" and {name}.png")
            + (f"; still to run: {res['missing']}" if res["missing"] else ""))
    return res["rows"]
