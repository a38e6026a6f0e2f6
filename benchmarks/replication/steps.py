"""Kind ``replication_step``: one command of a replication run, resumable across device calls and kept within
the suite's device-time budget (deferred when too little is left, SIGTERM ``grace_s`` before the budget ends,
SIGKILL at the end); ``wait_concurrent`` waits for the steps started with ``concurrent``. See the package
docstring for the whole protocol.

In the command of a step ``{root}`` is the state folder, ``{run}`` the run's folder (``<root>/<run>``) and
``python`` this interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_ssm.config import ConfigBase, ConfigError, opt

from .claims import read_jsonl

__all__ = ["ReplicationStepOptions", "run_step", "wait_concurrent", "TRITON_DIR"]

TRITON_DIR = ".triton"     # under root: the steps' TRITON_CACHE_DIR; only its *.autotune.json files travel


def _fill(text: str, root: Path, run: str) -> str:
    return text.replace("{root}", str(root)).replace("{run}", str(root / run) if run else str(root))


def _all_exist(paths, root: Path, run: str) -> bool:
    return bool(paths) and all(Path(_fill(p, root, run)).exists() for p in paths)


def _has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("*/step_*/COMPLETE.json"))


def _recorded_ran(run_dir: Path, step: str) -> bool:
    """Whether ``<run>/calls.jsonl`` holds a call of ``step`` that ran to completion."""
    return any(rec.get("step") == step and rec.get("state") == "ran" for rec in read_jsonl(run_dir / "calls.jsonl"))


def _cut_after(run_dir: Path, step: str) -> float:
    """Seconds the longest fresh attempt of ``step`` ran before the budget stopped it (0: none was cut)."""
    return max((float(rec.get("wall_s", 0.0)) for rec in read_jsonl(run_dir / "calls.jsonl")
                if rec.get("step") == step and rec.get("state") == "stopped" and rec.get("fresh")), default=0.0)


def _environment() -> dict:
    import torch

    from elastic_ssm.utils.environment import environment

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
    spans_calls: bool = opt(False, "the run is meant to span back-to-back calls on one warm machine (its checkpoint "
                                   "stays there, too large for the carry: replication-long), so a fresh start is "
                                   "not held to the longest earlier cut attempt, and once resumed it starts with only "
                                   "grace_s + 30 s left (whatever needs_s says): each call's steps are checkpointed")

    def validate(self) -> None:
        if not self.args:
            raise ConfigError("ReplicationStepOptions.args: give the command, e.g. [python, -m, elastic_ssm.cli, "
                              "train, ...]")
        if min(self.grace_s, self.needs_s, self.timeout_s, self.reserve_s) < 0:
            raise ConfigError("ReplicationStepOptions: needs_s, timeout_s, grace_s and reserve_s must be >= 0")


RESUME_MARGIN_S = 30.0   # a resumed run's start-up (load the checkpoint) and a few steps before its SIGTERM


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
    missing = [_fill(p, root, opts.run) for p in opts.requires if not Path(_fill(p, root, opts.run)).exists()]
    if missing and _wait_for_producers(missing, ctx.log):        # a concurrent step still making its inputs
        missing = [p for p in missing if not Path(p).exists()]
    if missing:
        ctx.log(f"  {ctx.name}: waiting for {missing[0]}")
        return [{**row, "state": "waiting", "missing": missing[0]}]
    left = ctx.time_left() - opts.reserve_s
    fresh = not _has_checkpoint(run_dir)
    cut = _cut_after(run_dir, ctx.name) if fresh and not opts.spans_calls else 0.0   # starts over: no checkpoint
    needs = max(opts.needs_s, cut + opts.grace_s if cut else 0.0, 1.0)
    if opts.spans_calls and not fresh:          # it resumes and checkpoints on SIGTERM: any call makes progress,
        needs = opts.grace_s + RESUME_MARGIN_S  # the last one only needs its remaining steps (2026-12-04: 181)
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
    _CONCURRENT[thread] = {_fill(p, root, opts.run) for p in opts.outputs}
    ctx.log(f"  {ctx.name}: started alongside the next entries (the next report or pack entry waits for it)")
    return [started]


#: concurrent steps started by this process and not yet waited for (``wait_concurrent``) -> the paths they make,
#: in the order they started
_CONCURRENT: dict[threading.Thread, set[str]] = {}


def _wait_for_producers(paths: list[str], log=None) -> bool:
    """Wait for the concurrent steps still running whose outputs include one of ``paths`` (a step that needs a
    concurrent step's result waits for that step only, not for the others); True when it waited for any."""
    waited = False
    for thread, makes in [(t, m & set(paths)) for t, m in _CONCURRENT.items() if m & set(paths)]:
        if log and thread.is_alive():
            log(f"  waiting for {thread.name}, which makes {sorted(makes)[0]}")
        thread.join()
        del _CONCURRENT[thread]
        waited = True
    return waited


def wait_concurrent(log=None) -> int:
    """Wait for every concurrent step started so far; each ends by its own SIGTERM/SIGKILL deadline, so this
    returns before the suite's budget. The report and pack entries call it first. Returns how many it waited for."""
    n = 0
    while _CONCURRENT:
        thread = next(iter(_CONCURRENT))
        del _CONCURRENT[thread]
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
