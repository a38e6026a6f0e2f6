"""docs/results.md's claim-3 tables (MQAR recall needs the hybrid, ESSH Tables 21-22), rendered by
``benchmarks.results_page`` from ``docs/results/records/<run>/``:

* ``claim3``: each run's accuracy at T1 / T4 / T10 (its training's validation at its last step), the runs that
  ``replication-claim3`` names (seed 0) and those of ``replication-mqar-seeds`` that have a record (an ``eval.csv``);
* ``claim3-seeds``: each arm's mean [min, max] over its seeds beside Table 22 (L = 256, 32 pairs);
* ``claim3-steps``: every run's validation accuracy at each step all of them validated.
A run of the seeds suite without a record is "not run yet" and left out; rows never carry a number without one.
"""

from __future__ import annotations

import functools
from pathlib import Path

from benchmarks.replication.claims import base_of, collect_claim, read_jsonl
from benchmarks.replication.claims import markdown_table as table
from benchmarks.replication.seeds import seed_stats

__all__ = ["PAPER_MQAR", "PAPER_MQAR_SEEDS", "acc", "claim3", "claim3_data", "claim3_runs", "claim3_seeds",
           "claim3_steps", "seed_cell"]

_TIERS = ("T1", "T4", "T10")
#: ESSH Table 21 (L = 256, 32 pairs, 20k steps): accuracy at T1 / T4 / T10
PAPER_MQAR = {"mqar-hybrid": "0.999 / 0.998 / 0.999", "mqar-mixer": "0.011 / 0.023 / 0.024"}
#: ESSH Table 22 (seeds 0, 1, 2; L = 256, 32 pairs): mean [min, max] at T1, T4, T10
PAPER_MQAR_SEEDS = {"mqar-hybrid": ("0.792 [0.632, 0.999]", "0.846 [0.549, 0.998]", "0.937 [0.818, 0.999]"),
                    "mqar-mixer": ("0.010 [0.009, 0.011]", "0.022 [0.017, 0.024]", "0.024 [0.022, 0.025]")}


def acc(x: float) -> str:
    """Accuracy to 3 decimals, 4 at 0.99 and above (where 3 would hide the differences)."""
    return f"{x:.4f}" if x >= 0.99 else f"{x:.3f}"


def seed_cell(c: dict) -> str:
    """``mean [min, max]`` of a ``seed_stats`` cell (the mean alone for one seed)."""
    return acc(c["mean"]) if c["n"] == 1 else f"{acc(c['mean'])} [{acc(c['min'])}, {acc(c['max'])}]"


def _report_runs(suite: str) -> tuple[str, ...]:
    from benchmarks.suite import load_suite

    return tuple(next(e for e in load_suite(suite).entries if e.kind == "replication_report").options.runs)


def claim3_runs(records: Path) -> tuple[str, ...]:
    """``replication-claim3``'s runs, then those of ``replication-mqar-seeds`` with an ``eval.csv`` under
    ``records``, hybrid runs first, each arm's seeds in order."""
    first = _report_runs("replication-claim3")
    more = [r for r in _report_runs("replication-mqar-seeds")
            if r not in first and (records / r / "eval.csv").is_file()]
    return tuple(sorted((*first, *more), key=lambda r: (base_of(r) != "mqar-hybrid", r)))


@functools.cache
def claim3_data(records: Path) -> dict:
    """``collect_claim(3)`` of ``claim3_runs`` with ``seeds``: ``seed_stats`` of the accuracy."""
    data = collect_claim(3, records, claim3_runs(records))
    return {**data, "seeds": seed_stats(data["rows"], "accuracy")}


def claim3(records: Path) -> str:
    res, out = claim3_data(records), []
    for run in claim3_runs(records):
        r = {x["tier"]: x for x in res["rows"] if x["run"] == run}
        p = " / ".join(f"{r[t]['params'] / 1e6:.2f}" for t in _TIERS)
        out.append([run, p, f"{r['T10']['step']:,}", *[acc(r[t]["accuracy"]) for t in _TIERS],
                    PAPER_MQAR[base_of(run)]])
    return table(["run", "parameters T1 / T4 / T10 (M)", "validated at step", "T1", "T4", "T10",
                  "paper, Table 21: T1 / T4 / T10"], out)


def claim3_seeds(records: Path) -> str:
    st, out = claim3_data(records)["seeds"], []
    for arm, tiers in st.items():
        seeds = ", ".join(f"s{r.rsplit('-s', 1)[1]}" for r in tiers["T10"]["seeds"])
        out.append([arm, f"{tiers['T10']['n']} ({seeds})", *[seed_cell(tiers[t]) for t in _TIERS]])
        out.append([f"paper, Table 22 ({base_of(arm)})", "3 (0, 1, 2)", *PAPER_MQAR_SEEDS[base_of(arm)]])
    return table(["arm", "seeds", "T1 mean [min, max]", "T4", "T10"], out)


def claim3_steps(records: Path) -> str:
    runs = claim3_runs(records)
    val: dict[str, dict[int, dict[str, float]]] = {run: {} for run in runs}
    for run in runs:
        for r in read_jsonl(records / run / "metrics.jsonl"):
            if r.get("kind") == "eval":
                val[run].setdefault(r["step"], {})[r["tier"]] = r["accuracy"]
    steps = sorted(set.intersection(*(set(v) for v in val.values())))
    return table(["step", *[f"{run}: T1 / T4 / T10" for run in runs]],
                 [[f"{s:,}", *[" / ".join(acc(val[run][s][t]) for t in _TIERS) for run in runs]] for s in steps])
