"""Suite kind ``tests``: a pytest selection of the repository's ``tests/`` in a child process, run before the timings
(the checks live in the tests, never in the bench)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from benchmarks.kinds import run_child
from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["PytestOptions", "run_tests"]


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


def run_tests(opts: PytestOptions, ctx) -> list[dict]:
    """``python -m pytest ARGS -p no:cacheprovider`` in a child process: one row of counts and rc."""
    row = run_child([sys.executable, "-m", "pytest", *opts.args, "-p", "no:cacheprovider"], ctx, opts.timeout_s,
                    "pytest.log")
    tail = ctx.read_text("pytest.log").strip().splitlines()[-25:]
    ctx.log("\n".join(tail))
    summary = next((ln for ln in reversed(tail) if _COUNTS.search(ln)), "")
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _COUNTS.findall(summary)}
    return [{**{k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "xfailed")}, **row}]
