"""docs/results.md's tables of the evaluations on trained weights (``configs/bench/replication-evals.yaml``).

Rendered by ``benchmarks.results_page`` from ``docs/results/records/<run>/``:

* ``evals-importance``: knock-out and output-energy importance per spectral channel at full capacity
  (``importance-essh`` / ``importance-dense``: ``channel_importance.json`` of ``elastic-ssm importance``) as ESSH
  Table 31 reports it: the ordering ``-Spearman(k, importance_k)`` and the first-8 share, for energy and knock-out;
* ``evals-length``: bits per byte of every tier at the training length (1024: the seed-0 records ``essh-s0`` /
  ``dense-s0``, whose models the evaluation runs trained again with the same seed) and beyond it
  (``length-<model>``: ``eval.csv``, one row per tier and ``seq_len``), Table 19's sweep;
* ``evals-niah``: needle-in-a-haystack full-key accuracy per tier and depth (``niah-essh`` / ``niah-dense``:
  ``eval.csv`` of ``elastic-ssm niah``), Tables 17-18.

A run without records renders as "not run yet", so the page says what is missing instead of leaving a gap.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.replication.claims import markdown_table as _table
from benchmarks.replication.claims import read_csv as _rows

__all__ = ["RENDER_EVALS", "PAPER_IMPORTANCE", "plot_importance_records"]

#: ESSH Table 31 (370M, 3.7B tokens, seed 197): (ordering energy, ordering knock-out, share energy, share knock-out)
PAPER_IMPORTANCE = {"essh": (0.66, 0.82, 0.46, 0.64), "dense": (0.29, 0.29, 0.46, 0.36)}
_MODEL = {"essh": "ESSH capacity-mixed + SR", "dense": "dense control (nothing nested)"}
_MISSING = "not run yet (queue item 7)"


def importance(records: Path) -> str:
    rows = []
    for model, paper in PAPER_IMPORTANCE.items():
        path = records / f"importance-{model}" / "channel_importance.json"
        if path.is_file():
            r = json.loads(path.read_text())
            ours = [f"{r[k]:.2f}" for k in ("ordering_energy", "ordering_knockout", "share_energy", "share_knockout")]
            note = f"K = {r['K']}, first {r['first']}, {r['batches']} x {r['seq_len']} tokens"
        else:
            ours, note = ["", "", "", ""], _MISSING
        rows.append([_MODEL[model], *ours, " / ".join(f"{p:.2f}" for p in paper), note])
    return _table(["model", "ordering, energy", "ordering, knock-out", "first-8 share, energy",
                   "first-8 share, knock-out", "paper (Table 31, same four)", "run"], rows)


def length(records: Path) -> str:
    lengths = (1024, 2048, 4096)
    rows = []
    for model in PAPER_IMPORTANCE:
        by_len: dict[int, dict[str, float]] = {L: {} for L in lengths}
        for run in (f"{model}-s0", f"length-{model}"):     # the training length, then the sweep's seq_len rows
            for r in _rows(records / run / "eval.csv"):
                if r["tier"][:1] == "T" and r["tier"][1:].isdigit() and int(r["seq_len"]) in by_len:
                    by_len[int(r["seq_len"])][r["tier"]] = r["bpb"]               # named tiers, not fractions
        tiers = sorted({t for v in by_len.values() for t in v}, key=lambda t: int(t[1:]))
        if not any(by_len[L] for L in (2048, 4096)):
            rows.append([_MODEL[model], "", "", "", "", _MISSING])
            continue
        for t in tiers:
            cells = [f"{by_len[L][t]:.3f}" if t in by_len[L] else "" for L in lengths]
            drift = (f"{by_len[4096][t] - by_len[1024][t]:+.3f}" if t in by_len[4096] and t in by_len[1024] else "")
            rows.append([_MODEL[model], t, *cells, drift])
    return _table(["model", "tier", "bpb at 1024 (trained)", "2048", "4096", "4096 - 1024"], rows)


def niah(records: Path) -> str:
    head = ["model", "tier", "full key", "first token", "+/- (95%)", "depths"]
    out = []
    for model in PAPER_IMPORTANCE:
        rows = _rows(records / f"niah-{model}" / "eval.csv")
        if not rows:
            out.append([_MODEL[model], "", "", "", "", _MISSING])
            continue
        depths = [k for k in rows[0] if k.startswith("d")]
        head[-1] = "depths " + " / ".join(d[1:] for d in depths)
        out += [[_MODEL[model], r["tier"], f"{float(r['full_key']):.3f}", f"{float(r['first_token']):.3f}",
                 f"{float(r['half_width']):.3f}", " / ".join(f"{float(r[d]):.2f}" for d in depths)] for r in rows]
    return _table(head, out)


RENDER_EVALS = {"evals-importance": importance, "evals-length": length, "evals-niah": niah}


def plot_importance_records(records: Path, path: Path) -> str:
    """Table 31's per-channel curves of both models in one PNG at ``path``: (a) each channel's share of the
    knock-out increase (bpb), (b) the cumulative knock-out and energy shares against channel k, from
    ``importance-<model>/channel_importance.json``. Returns '' when written, else why not (no records, no
    matplotlib)."""
    runs = {m: records / f"importance-{m}" / "channel_importance.json" for m in PAPER_IMPORTANCE}
    runs = {m: json.loads(p.read_text()) for m, p in runs.items() if p.is_file()}
    if not runs:
        return "no importance records"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'elastic-ssm[plot]')"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(runs)
    for i, (model, r) in enumerate(runs.items()):
        ks = [c["channel"] for c in r["channels"]]
        knock = [max(c["delta_bpb"], 0.0) for c in r["channels"]]
        energy = [c["energy"] for c in r["channels"]]
        a.bar([k + (i - (len(runs) - 1) / 2) * width for k in ks], [x / sum(knock) for x in knock], width,
              label=_MODEL[model])
        for vals, style, what in ((knock, "o-", "knock-out"), (energy, "s--", "energy")):
            cum = [sum(vals[:j + 1]) / sum(vals) for j in range(len(vals))]
            b.plot(ks, cum, style, color=f"C{i}", markersize=3, label=f"{_MODEL[model]}, {what}")
    first = next(iter(runs.values()))["first"]
    b.axvline(first, color="gray", linestyle=":")
    a.set(xlabel="channel k", ylabel="share of the knock-out increase (bpb)", title="(a) knock-out per channel")
    b.set(xlabel="channel k", ylabel="cumulative share", title=f"(b) cumulative shares (first {first}: dotted)")
    a.legend(fontsize=8)
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle("channel importance at full capacity, seed 0 (ESSH Table 31, Figure 10)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


if __name__ == "__main__":   # python -m benchmarks.results_evals: redraw docs/results/importance.png from the records
    import sys

    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    why = plot_importance_records(root / "records", root / "importance.png")
    print(why or f"wrote {root / 'importance.png'}")
    sys.exit(1 if why else 0)
