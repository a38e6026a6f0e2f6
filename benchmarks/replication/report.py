"""Kind ``replication_report``: one claim's per-tier numbers from its runs into ``<root>/results/claimN.json`` and
its plot ``claimN.png`` (``claims.py``, ``plot.py``), after the concurrent steps have ended."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from elastic_ssm.config import ConfigBase, ConfigError, opt

from .claims import collect_claim, final_eval_csv
from .plot import plot_claim
from .steps import wait_concurrent

__all__ = ["ReplicationReportOptions", "run_report"]


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
    wait_concurrent(ctx.log)
    for run in opts.runs:             # a run evaluated only by its training's validation (MQAR): its eval.csv
        if (written := final_eval_csv(Path(opts.root) / run)) is not None:
            ctx.log(f"  wrote {written} from its last validation")
    res = collect_claim(opts.claim, opts.root, opts.runs)
    out = Path(opts.root) / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = f"claim{opts.claim}" if opts.claim else "calibration"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    skipped = plot_claim(res, out / f"{name}.png")
    ctx.log(f"  wrote {out / (name + '.json')}" + (f"; plot skipped: {skipped}" if skipped else f" and {name}.png")
            + (f"; still to run: {res['missing']}" if res["missing"] else ""))
    return res["rows"]
