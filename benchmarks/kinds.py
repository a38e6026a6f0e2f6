"""Entry kinds of a bench suite (``suite.py``): ``KINDS`` maps each to its options dataclass and
``run(options, ctx) -> rows``.

The kinds ``bench`` (one ``elastic_ssm.bench.run_bench``) and ``command`` live here; the other kinds are modules of
this harness, imported by name through ``elastic_ssm.bench.harness_module`` (the current folder
or the checkout when they are not importable, else loading the suite is a one-line ``ConfigError``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from elastic_ssm.bench import BenchConfig, harness_module, run_bench
from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["KINDS", "kind_options", "kind_runner", "run_child", "run_bench_entry", "CommandOptions", "run_command"]

#: kind -> (module, options class, run function), every module one of this harness
KINDS: dict[str, tuple[str, str, str]] = {
    "bench": ("benchmarks.kinds", "BenchConfig", "run_bench_entry"),
    "tests": ("benchmarks.tests_kind", "PytestOptions", "run_tests"),
    "command": ("benchmarks.kinds", "CommandOptions", "run_command"),
    "session_prefill": ("benchmarks.generate_paths", "SessionPrefillOptions", "run_session_prefill"),
    "generate_paths": ("benchmarks.generate_paths", "GeneratePathsOptions", "run_generate_paths"),
    "first_token": ("benchmarks.first_token", "FirstTokenOptions", "run_first_token"),
    "train_matrix": ("benchmarks.multigpu", "TrainMatrixOptions", "run_matrix"),
    "train_scaling": ("benchmarks.multigpu", "TrainScalingOptions", "run_scaling"),
    "profile": ("benchmarks.profiling", "ProfileOptions", "run_profile"),
    "gemv_sweep": ("benchmarks.gemv_sweep", "GemvSweepOptions", "run_sweep"),
    "scan_timing": ("benchmarks.scan_timing", "ScanTimingOptions", "run_scan_timing"),
    "checksum_cost": ("benchmarks.checksum", "ChecksumOptions", "run_checksum"),
    "es_ssm_report": ("benchmarks.es_ssm_report", "EsSsmReportOptions", "run_es_ssm_report"),
    "es_ssm_decode": ("benchmarks.es_ssm_decode", "EsSsmDecodeOptions", "run_es_ssm_decode"),
    "memory": ("benchmarks.memory", "MemoryOptions", "run_memory"),
    "replication_step": ("benchmarks.replication.steps", "ReplicationStepOptions", "run_step"),
    "replication_state": ("benchmarks.replication.state", "ReplicationStateOptions", "run_state"),
    "replication_report": ("benchmarks.replication.report", "ReplicationReportOptions", "run_report"),
}


def kind_options(kind: str) -> type[ConfigBase]:
    """The options dataclass of ``kind`` (one-line ``ConfigError`` for an unknown kind or a harness kind whose
    ``benchmarks/`` folder cannot be found)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown entry kind {kind!r}; choose from {sorted(KINDS)}")
    module, cls, _ = KINDS[kind]
    return getattr(harness_module(f"entry kind {kind!r}", module), cls)


def kind_runner(kind: str):
    """The run function of ``kind``."""
    module, _, fn = KINDS[kind]
    return getattr(harness_module(f"entry kind {kind!r}", module), fn)


def run_child(cmd: list[str], ctx, timeout: float, log_name: str, echo: bool = False) -> dict:
    """Run ``cmd`` (cwd: the current folder, env: ``ctx.child_env()``); its output goes line by line to
    ``ctx.out_dir/log_name`` (and, with ``echo``, to ``ctx.log``) as it comes, so a call cut from outside keeps
    what the command printed. Stopped (process group killed) at ``timeout`` or the suite's budget: rc 'timeout'."""
    limit = min(timeout or float("inf"), ctx.time_left())
    t = time.monotonic()
    lines: list[str] = []
    with open(ctx.path(log_name), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, env=ctx.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in p.stdout:
                lines.append(line.rstrip("\n"))
                log.write(line)
                log.flush()
                if echo:
                    ctx.log(f"  | {lines[-1]}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=None if limit == float("inf") else max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "timeout"
        reader.join(timeout=5)
    text = [x for x in lines if x.strip()]
    return {"rc": rc, "wall_s": round(time.monotonic() - t, 2), "last_line": text[-1][-300:] if text else ""}


def run_bench_entry(cfg: BenchConfig, ctx) -> list[dict]:
    """Kind ``bench``: ``run_bench`` within the suite's remaining budget (its JSON in ``results.json``); the rows of
    every section, then the ratios, each with its ``section``."""
    left = ctx.time_left()
    cfg = cfg.replace(out="", docs="", suite="", time_budget_s=left if left != float("inf") else 0.0)
    res = run_bench(cfg, log=ctx.log, print_tables=False)
    ctx.save_json("results.json", res)
    return [{"section": name, **row} for name, rows in res.items() if isinstance(rows, list) for row in rows]


@dataclass(kw_only=True)
class CommandOptions(ConfigBase):
    """Any command as an entry (e.g. ``torchrun --nproc_per_node 2 -m benchmarks.ddp_check``)."""

    args: tuple[str, ...] = opt((), "the command and its arguments; 'python' runs this interpreter, '{out}' is "
                                    "replaced by the entry's folder")
    timeout_s: float = opt(0.0, "stop it after this many seconds (0: the suite's remaining budget)")

    def validate(self) -> None:
        if not self.args:
            raise ConfigError("CommandOptions.args: give the command, e.g. [python, -m, benchmarks.ddp_check]")


def run_command(opts: CommandOptions, ctx) -> list[dict]:
    """Run the command; one row: rc, wall seconds, last output line (the whole output in ``command.log``)."""
    cmd = [sys.executable if a == "python" else a.replace("{out}", str(ctx.out_dir)) for a in opts.args]
    row = run_child(cmd, ctx, opts.timeout_s, "command.log", echo=True)
    ctx.log(f"  rc={row['rc']} {row['wall_s']} s: {row['last_line']}")
    return [row]
