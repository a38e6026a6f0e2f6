"""docs/results.md's tables of the evaluations on trained weights (``configs/bench/replication-evals.yaml``).

Rendered by ``benchmarks.results_page`` from ``docs/results/records/<run>/``:

* ``evals-importance``: knock-out and output-energy importance per spectral channel at full capacity
  (``importance-essh`` / ``importance-dense``: ``channel_importance.json`` of ``elastic-ssm importance``) as ESSH
  Table 31 reports it: the ordering ``-Spearman(k, importance_k)`` and the first-8 share, for energy and knock-out;
* ``evals-length``: bits per byte of every tier at the training length (1024: the seed-0 records ``essh-s0`` /
  ``dense-s0``, whose models the evaluation runs trained again with the same seed) and beyond it
  (``length-<model>-2048``, ``-4096``: ``eval.csv``), Table 19's sweep;
* ``evals-niah``: needle-in-a-haystack full-key accuracy per tier and depth (``niah-essh``: ``eval.csv`` of
  ``elastic-ssm niah``), Tables 17-18.

A run without records renders as "not run yet", so the page says what is missing instead of leaving a gap.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.replication.claims import markdown_table as _table
from benchmarks.replication.claims import read_csv as _rows

__all__ = ["RENDER_EVALS", "PAPER_IMPORTANCE"]

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
    lengths = {1024: "{model}-s0", 2048: "length-{model}-2048", 4096: "length-{model}-4096"}
    rows = []
    for model in PAPER_IMPORTANCE:
        by_len = {L: {r["tier"]: r["bpb"] for r in _rows(records / run.format(model=model) / "eval.csv")
                      if r["tier"][:1] == "T" and r["tier"][1:].isdigit()}       # the named tiers, not fractions
                  for L, run in lengths.items()}
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
    rows = _rows(records / "niah-essh" / "eval.csv")
    if not rows:
        return _table(["tier", "full key", "first token", "+/- (95%)", "depths 0.1 / 0.3 / 0.5 / 0.7 / 0.9"],
                      [["", "", "", "", _MISSING]])
    depths = [k for k in rows[0] if k.startswith("d")]
    return _table(["tier", "full key", "first token", "+/- (95%)", "depths " + " / ".join(d[1:] for d in depths)],
                  [[r["tier"], f"{float(r['full_key']):.3f}", f"{float(r['first_token']):.3f}",
                    f"{float(r['half_width']):.3f}", " / ".join(f"{float(r[d]):.2f}" for d in depths)] for r in rows])


RENDER_EVALS = {"evals-importance": importance, "evals-length": length, "evals-niah": niah}
