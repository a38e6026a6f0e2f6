"""docs/results.md's claim-1 tables about run-to-run noise and the baseline's tuning, rendered by
``benchmarks.results_page`` from ``docs/results/records/<run>/``:

* ``claim1-repeat``: each same-seed repeat (``<run>-retrain``: the same config, seed and data order trained again)
  beside its first run: the first logged losses, the largest early gradient norm and bits per byte at T1, T4, T10;
* ``claim1-baselines``: the dense Transformer++ and MatFormer (claim 1's Table 10 baselines) at each learning rate
  that ran (``<arm>-lr<lr>``); ``best_run`` names the one the page compares with ESSH (the lowest bits per byte: the
  paper's baselines are tuned, and an untuned learning rate would flatter ESSH);
* ``claim1-long``: the 4x point (issue 37 item 2): seed 0's shared ESSH and dense control at 650 steps (``essh-s0``,
  ``dense-s0``) beside the same seed at 2,600 steps (``essh-long-s0``, ``dense-long-s0``), every tier, and the
  shared - truncated dense gap at each length; a run without records renders as "not run yet".
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.replication.claims import markdown_table as table
from benchmarks.replication.claims import read_csv, read_jsonl, run_summary

__all__ = ["LONG", "REPEATS", "baselines_table", "best_run", "commits_of", "long_clause", "long_gaps", "long_table",
           "lr_runs", "repeat_table"]

#: (first run, its same-seed repeat)
REPEATS = (("essh-s0", "essh-s0-retrain"), ("dense-s0", "dense-s0-retrain"))
_TIERS = ("T1", "T4", "T10")


def _bpb(records: Path, run: str) -> dict[str, float]:
    return {r["tier"]: r["bpb"] for r in read_csv(records / run / "eval.csv")}


def commits_of(summary: dict) -> str:
    """The commits a run's calls ran at (its ``run_summary``'s environment lines), sorted."""
    return ", ".join(sorted({e.split("commit ")[-1] for e in summary.get("environment", [])}))


def repeat_table(records: Path) -> str:
    """Every pair of ``REPEATS`` whose two runs have records; a pair's third row is repeat - first per tier."""
    out = []
    for first, again in REPEATS:
        if not all((records / r / "eval.csv").is_file() for r in (first, again)):
            continue
        bpb = {r: _bpb(records, r) for r in (first, again)}
        for run in (first, again):
            train = {r["step"]: r for r in read_jsonl(records / run / "metrics.jsonl") if r.get("kind") == "train"}
            out.append([run, commits_of(run_summary(records / run)),
                        *(f"{train[k]['loss']:.3f}" if k in train else "" for k in (10, 20, 30)),
                        f"{max(r['grad_norm'] for k, r in train.items() if k <= 50):.2f}",
                        *(f"{bpb[run][t]:.3f}" if t in bpb[run] else "" for t in _TIERS)])
        out.append([f"{again} - {first}", "", "", "", "", "",
                    *(f"{bpb[again][t] - bpb[first][t]:+.3f}" if t in bpb[first] and t in bpb[again] else ""
                      for t in _TIERS)])
    return table(["run (seed 0)", "commit", "loss step 10", "loss step 20", "loss step 30",
                  "max grad norm, steps <= 50", "T1 bpb", "T4 bpb", "T10 bpb"], out)


def _full_bpb(bpb: dict[str, float]) -> float:
    """Bits per byte of the full model: the widest ``T<n>`` row of an eval.csv."""
    return bpb[max((t for t in bpb if t[1:].isdigit()), key=lambda t: int(t[1:]))]


def lr_runs(records: Path, arm: str) -> dict[str, tuple[float, float]]:
    """``arm``'s runs at each learning rate (folders ``arm`` and ``arm-lr<lr>``) -> (peak lr, full-model bits per
    byte), for the runs evaluated."""
    out = {}
    for d in sorted([records / arm, *records.glob(f"{arm}-lr*")]):
        bpb = _bpb(records, d.name) if d.is_dir() else {}
        if bpb:
            out[d.name] = (run_summary(d)["train"]["optim"]["lr"], _full_bpb(bpb))
    return out


def best_run(records: Path, arm: str) -> str:
    """``arm``'s run of the lowest full-model bits per byte over the learning rates that ran (the tuned one)."""
    return _lowest(lr_runs(records, arm))


def _lowest(runs: dict[str, tuple[float, float]]) -> str:
    return min(runs, key=lambda r: runs[r][1])


def baselines_table(records: Path) -> str:
    """Claim 1's baselines (Table 10) at every learning rate that ran; the lowest is the one the page compares."""
    rows = []
    for label, arm in (("Transformer++ dense", "transformer"), ("MatFormer, full width", "matformer")):
        runs = lr_runs(records, arm)
        best = _lowest(runs)
        for run, (lr, bpb) in sorted(runs.items(), key=lambda kv: kv[1][0]):
            s = run_summary(records / run)
            rows.append([label, run, f"{lr:g}", f"{bpb:.3f}", f"{s['wall_s']:.1f}" if s.get("wall_s") else "",
                         commits_of(s), "yes" if run == best else ""])
    return table(["baseline", "run", "peak lr", "bpb (full model)", "wall s (training calls)", "commit",
                  "the page compares this one"], rows)


#: the 4x point's runs: (model, 650-step run, 2,600-step run)
LONG = (("ESSH", "essh-s0", "essh-long-s0"), ("dense", "dense-s0", "dense-long-s0"))


def long_gaps(records: Path) -> dict[str, float]:
    """Shared ESSH - dense control per tier at 2,600 steps (empty until both 4x runs have an ``eval.csv``)."""
    e, d = (_bpb(records, run) for _, _, run in LONG)
    return {t: e[t] - d[t] for t in e if t in d}


def long_clause(records: Path, noise: float) -> str:
    """The summary's 4x sentence: T10 shared - dense at 2,600 steps against the paper's sign and ``noise`` (the 1x
    runs' largest same-seed repeat shift at T10); "" until both runs are evaluated."""
    g = long_gaps(records).get("T10")
    if g is None:
        return ""
    return (f"; at 4x the tokens (seed 0 alone) T10 shared - dense {g:+.3f}, {'the' if g > 0 else 'not the'} paper's "
            f"sign (Table 37), {'inside' if abs(g) < noise else 'outside'} the 1x same-seed repeats' {noise:.3f}")


def long_table(records: Path) -> str:
    """Bits per byte per tier at 650 and 2,600 steps (seed 0), and shared ESSH - truncated dense at each."""
    bpb = {run: _bpb(records, run) for _, short, long in LONG for run in (short, long)}
    head = ["tier"] + [f"{m} {n} steps" for m, *_ in LONG for n in ("650", "2,600")]
    head += ["ESSH - dense, 650", "ESSH - dense, 2,600"]
    rows = []
    for i in range(1, 11):
        t = f"T{i}"
        cells = [bpb[run].get(t) for _, short, long in LONG for run in (short, long)]
        gaps = [bpb[e][t] - bpb[d][t] if t in bpb[e] and t in bpb[d] else None
                for e, d in ((LONG[0][1], LONG[1][1]), (LONG[0][2], LONG[1][2]))]
        rows.append([t] + [f"{x:.3f}" if x is not None else "" for x in cells]
                    + [f"{g:+.3f}" if g is not None else "" for g in gaps])
    missing = [run for _, *runs in LONG for run in runs if not bpb[run]]
    if missing:
        rows.append(["not run yet: " + ", ".join(missing)] + [""] * (len(head) - 1))
    return table(head, rows)
