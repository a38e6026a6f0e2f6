"""Entry kinds of a bench suite: each is an options dataclass (the entry's keys in the suite YAML) and a
function ``run(options, ctx) -> rows``; this file is the registry and holds the three generic kinds.

===============  =====================================  =====================================================
kind             options                                what one entry does
===============  =====================================  =====================================================
bench            ``BenchConfig``                        ``run_bench`` (memory/decode/prefill/generate/train/
                                                        serve/es_ssm_decode), rows per section
tests            ``PytestOptions``                      a pytest selection in a child process (the ``gpu``
                                                        tests are where correctness is checked)
command          ``CommandOptions``                     any command (e.g. ``torchrun -m ...``): rc, time
session_prefill  ``prefill.SessionPrefillOptions``      generate's prefill (eager or graphed compiled)
generate_paths   ``generate.GeneratePathsOptions``      generate per token: reference vs fused step (CPU)
first_token      ``process.FirstTokenOptions``          fresh processes' first token by phase
train_matrix     ``multigpu.TrainMatrixOptions``        ``elastic-ssm train`` per recipe x parallel x ...
train_scaling    ``multigpu.TrainScalingOptions``       1 GPU vs N GPUs, same global batch, loss curves
profile          ``profiling.ProfileOptions``           time and top kernels of one workload
gemv_sweep       ``gemv_sweep.GemvSweepOptions``        fused decode products per tile vs cuBLAS
scan_timing      ``scan_timing.ScanTimingOptions``      the spectral scan per path and shape
checksum_cost    ``checksum.ChecksumOptions``           sha256 cost of saving and loading a preset
es_ssm_report    ``es_ssm_decode.EsSsmReportOptions``   modal vs exact ES-SSM decoding, bits per byte
replication_*    ``replication.ReplicationStepOptions``  issue 16's runs across device calls: a resumable
                 ``...StateOptions``, ``...ReportOptions``  step, carrying the state, a claim's JSON and plot
===============  =====================================  =====================================================

``ctx`` (``suite.EntryContext``) gives the entry its folder (``ctx.out_dir``), a log, the time left in
the suite's budget (``ctx.time_left()``) and the entry's ``env`` (set around in-process kinds, passed to
child processes by ``ctx.child_env()``).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from ..config import ConfigBase, ConfigError, opt

__all__ = ["KINDS", "kind_options", "kind_runner", "PytestOptions", "CommandOptions"]

#: kind -> (module under elastic_ssm.bench, options class, run function)
KINDS: dict[str, tuple[str, str, str]] = {
    "bench": ("elastic_ssm.bench", "BenchConfig", "elastic_ssm.bench.kinds:run_bench_entry"),
    "tests": ("elastic_ssm.bench.kinds", "PytestOptions", "elastic_ssm.bench.kinds:run_tests"),
    "command": ("elastic_ssm.bench.kinds", "CommandOptions", "elastic_ssm.bench.kinds:run_command"),
    "session_prefill": ("elastic_ssm.bench.prefill", "SessionPrefillOptions",
                        "elastic_ssm.bench.prefill:run_session_prefill"),
    "generate_paths": ("elastic_ssm.bench.generate", "GeneratePathsOptions",
                       "elastic_ssm.bench.generate:run_generate_paths"),
    "first_token": ("elastic_ssm.bench.process", "FirstTokenOptions", "elastic_ssm.bench.process:run_first_token"),
    "train_matrix": ("elastic_ssm.bench.multigpu", "TrainMatrixOptions", "elastic_ssm.bench.multigpu:run_matrix"),
    "train_scaling": ("elastic_ssm.bench.multigpu", "TrainScalingOptions",
                      "elastic_ssm.bench.multigpu:run_scaling"),
    "profile": ("elastic_ssm.bench.profiling", "ProfileOptions", "elastic_ssm.bench.profiling:run_profile"),
    "gemv_sweep": ("elastic_ssm.bench.gemv_sweep", "GemvSweepOptions", "elastic_ssm.bench.gemv_sweep:run_sweep"),
    "scan_timing": ("elastic_ssm.bench.scan_timing", "ScanTimingOptions",
                    "elastic_ssm.bench.scan_timing:run_scan_timing"),
    "checksum_cost": ("elastic_ssm.bench.checksum", "ChecksumOptions", "elastic_ssm.bench.checksum:run_checksum"),
    "es_ssm_report": ("elastic_ssm.bench.es_ssm_decode", "EsSsmReportOptions",
                      "elastic_ssm.bench.es_ssm_decode:run_es_ssm_report"),
    "replication_step": ("elastic_ssm.bench.replication", "ReplicationStepOptions",
                         "elastic_ssm.bench.replication:run_step"),
    "replication_state": ("elastic_ssm.bench.replication", "ReplicationStateOptions",
                          "elastic_ssm.bench.replication:run_state"),
    "replication_report": ("elastic_ssm.bench.replication", "ReplicationReportOptions",
                           "elastic_ssm.bench.replication:run_report"),
}


def kind_options(kind: str) -> type[ConfigBase]:
    """The options dataclass of ``kind`` (one-line ``ConfigError`` for an unknown kind)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown entry kind {kind!r}; choose from {sorted(KINDS)}")
    module, cls, _ = KINDS[kind]
    return getattr(importlib.import_module(module), cls)


def kind_runner(kind: str):
    module, fn = KINDS[kind][2].split(":")
    return getattr(importlib.import_module(module), fn)


# ---- bench ---------------------------------------------------------------------------------------------
def run_bench_entry(cfg, ctx) -> list[dict]:
    """``run_bench`` with the suite's remaining budget; rows of every section, each with its ``section``."""
    from . import report, run_bench

    left = ctx.time_left()
    cfg = cfg.replace(out="", docs="", suite="", time_budget_s=left if left != float("inf") else 0.0)
    res = run_bench(cfg, log=ctx.log, print_tables=False)
    ctx.save_json("results.json", res)
    rows = [{"section": name, **row} for name in report.SECTIONS for row in res.get(name, [])]
    return rows + [{"section": "ratios", **row} for row in res.get("ratios", [])]


# ---- tests ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class PytestOptions(ConfigBase):
    """A pytest selection run before the timings (the checks live in the tests, never in the bench)."""

    args: tuple[str, ...] = opt((), "pytest arguments, e.g. [-m, gpu, tests/models/test_generate_gpu.py, -k, graph]")
    timeout_s: float = opt(0.0, "stop the run after this many seconds (0: the suite's remaining budget)")

    def validate(self) -> None:
        if not self.args:
            raise ConfigError("PytestOptions.args: name the tests to run, e.g. "
                              "[-m, gpu, tests/models/test_generate_gpu.py]")


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def _subprocess(cmd: list[str], ctx, timeout: float, log_name: str) -> dict:
    """Run ``cmd`` (cwd: the current folder, env: ``ctx.child_env()``); output to ``ctx.out_dir/log_name``."""
    limit = min(timeout or float("inf"), ctx.time_left())
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, env=ctx.child_env(), capture_output=True, text=True,
                           timeout=None if limit == float("inf") else max(1.0, limit))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x]
        rc, text = "timeout", "".join(parts)
    ctx.write_text(log_name, " ".join(cmd) + "\n" + text)
    lines = text.strip().splitlines()
    return {"rc": rc, "wall_s": round(time.monotonic() - t, 2), "last_line": lines[-1][-300:] if lines else ""}


def run_tests(opts: PytestOptions, ctx) -> list[dict]:
    """``python -m pytest ARGS -p no:cacheprovider`` in a child process: one row of counts and rc."""
    row = _subprocess([sys.executable, "-m", "pytest", *opts.args, "-p", "no:cacheprovider"], ctx, opts.timeout_s,
                      "pytest.log")
    text = ctx.read_text("pytest.log")
    tail = text.strip().splitlines()[-25:]
    ctx.log("\n".join(tail))
    summary = next((ln for ln in reversed(tail) if _COUNTS.search(ln)), "")
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _COUNTS.findall(summary)}
    return [{**{k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "xfailed")}, **row}]


# ---- command -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class CommandOptions(ConfigBase):
    """Any command as an entry (e.g. ``torchrun --nproc_per_node 2 -m elastic_ssm.bench.ddp_check``)."""

    args: tuple[str, ...] = opt((), "the command and its arguments; 'python' runs this interpreter, '{out}' is "
                                    "replaced by the entry's folder")
    timeout_s: float = opt(0.0, "stop it after this many seconds (0: the suite's remaining budget)")

    def validate(self) -> None:
        if not self.args:
            raise ConfigError("CommandOptions.args: give the command, e.g. [python, -m, elastic_ssm.bench.ddp_check]")


def run_command(opts: CommandOptions, ctx) -> list[dict]:
    """Run the command; one row: rc, wall seconds, last output line (the whole output in ``command.log``)."""
    cmd = [sys.executable if a == "python" else a.replace("{out}", str(ctx.out_dir)) for a in opts.args]
    row = _subprocess(cmd, ctx, opts.timeout_s, "command.log")
    ctx.log(f"  rc={row['rc']} {row['wall_s']} s: {row['last_line']}")
    return [row]
