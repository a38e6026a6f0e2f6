"""The plots of the replication claims (``claims.collect_claim``'s JSON -> PNG): claim 1 and 4 bits per byte
against parameters per arm (claim 1: the mean over seeds, bars from the lowest to the highest seed), claim 2 bpb per
budget, claim 3 MQAR accuracy per tier, claim 5 wall seconds and quality at the specialists' sizes, and the
calibration's tokens/s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .claims import ROLES, _role, base_of
from .seeds import seed_stats

__all__ = ["plot_claim"]


def plot_claim(res: dict[str, Any], path: str | Path) -> str:
    """Draw the claim's plot into ``path`` (PNG); returns '' or why it was skipped (no matplotlib, no rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'elastic-ssm[plot]')"
    rows, claim = res["rows"], res["claim"]
    if not rows and claim not in (0, 5):
        return "no results yet"
    if claim == 5:
        fig, (ax, quality) = plt.subplots(1, 2, figsize=(12, 4.5))
        _plot_quality_at_sizes(quality, res["summary"].get("at_sizes", []))
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    if claim in (1, 4):
        styles = {"elastic": "o-", "truncated": "x--", "recovered": "s-.", "specialist": "*", "matformer": "^:",
                  "baseline": "D"}
        for arm, tiers in (res["summary"].get("seeds") or seed_stats(rows)).items():
            first = next(r for r in rows if r["arm"] == arm)
            size = {str(r["tier"]): r["params"] for r in rows if r["arm"] == arm}
            pts = sorted(((size[t], c, t) for t, c in tiers.items()), key=lambda x: x[0])
            style = styles.get(first["role"], "o-")
            _seed_curve(ax, [(p / 1e6, c) for p, c, _ in pts], first["label"], seeds=claim == 1, fmt=style,
                        markersize={"*": 10, "D": 7}.get(style, 5), capsize=3)
            pts = [(p, c["mean"], next(r for r in rows if r["arm"] == arm and str(r["tier"]) == t))
                   for p, c, t in pts]
            if claim == 4:
                new = [(p, b) for p, b, r in pts if r.get("trained_shape") is False]
                ax.scatter([p / 1e6 for p, _ in new], [b for _, b in new], s=80, facecolors="none", edgecolors="red",
                           label="shape never sampled in training")
        ax.set_xscale("log")
        ax.set_xlabel("parameters of the standalone model (M)")
        ax.set_ylabel("held-out bits per byte")
    elif claim == 2:                 # each arm's mean over its seeds, bars from the lowest to the highest seed
        for arm, tiers in (res["summary"].get("seeds") or seed_stats(rows)).items():
            k_of = {str(r["tier"]): r["K"] for r in rows if r["arm"] == arm}
            pts = sorted(((k_of[t], c) for t, c in tiers.items()), key=lambda x: x[0])
            _seed_curve(ax, pts, ROLES.get(arm, (arm,))[0], fmt="o-", markersize=3, capsize=2)
        ax.set_xlabel("budget K (spectral channels kept)")
        ax.set_ylabel("held-out bits per byte")
    elif claim == 3:
        for run in dict.fromkeys(r["run"] for r in rows):
            pts = [(r["tier"], r["accuracy"]) for r in rows if r["run"] == run]
            label = f"{ROLES.get(base_of(run), (run,))[0]} ({run})"
            ax.plot([t for t, _ in pts], [a for _, a in pts], "o-", label=label)
        ax.set_xlabel("tier")
        ax.set_ylabel("MQAR accuracy")
        ax.set_ylim(0, 1.05)
    elif claim == 5:
        _plot_cost(ax, res["summary"])
    else:
        names = [n for n, s in res["runs"].items() if s.get("tokens_per_s")]
        ax.bar(names, [res["runs"][n]["tokens_per_s"] for n in names])
        ax.set_ylabel("steady tokens/s (warm-up steps left out)")
    ax.set_title(f"#16 claim {claim}: {res['title']}" if claim else res["title"], fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    handles = ax.get_legend_handles_labels()[0]
    if len(handles) > 6:             # claim 1's dozen arms: below the axes, where it hides no point
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    elif handles:
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return ""


def _seed_curve(ax: Any, pts: list[tuple[float, dict[str, Any]]], label: str, seeds: bool = True, **style: Any) -> None:
    """One arm's curve over ``pts`` [(x, {mean, min, max, n})]: the means, bars from the lowest to the highest seed;
    ``seeds``: the label says how many seeds and what the bars are."""
    if seeds:
        label += f" (n={'-'.join(map(str, sorted({c['n'] for _, c in pts})))} seeds, mean, min-max)"
    ax.errorbar([x for x, _ in pts], [c["mean"] for _, c in pts], label=label,
                yerr=[[c["mean"] - c["min"] for _, c in pts], [c["max"] - c["mean"] for _, c in pts]], **style)


def _plot_cost(ax: Any, summary: dict[str, Any]) -> None:
    """Claim 5, left: wall seconds of training per way of getting the models, the specialists stacked."""
    cost = summary.get("runs", {})
    wall = lambda n: cost.get(n, {}).get("wall_s") or 0.0   # noqa: E731
    by_role = lambda role: [n for n in cost if _role(n) == role and wall(n)]   # noqa: E731
    bars = [("one shared run\n(every tier)", by_role("elastic")),
            ("a specialist\nper size", summary.get("specialists") or []),
            ("dense control\n+ recovery", by_role("truncated") + by_role("recovered")),
            ("MatFormer\n(every tier)", by_role("matformer")),
            ("Transformer++\n(one size)", by_role("baseline"))]
    bars = [(label, [n for n in names if wall(n)]) for label, names in bars if any(wall(n) for n in names)]
    colour = {n: f"C{i}" for i, n in enumerate(cost)}          # a run keeps its colour in every bar
    for i, (_, names) in enumerate(bars):
        left = 0.0
        for n in names:
            ax.barh(i, wall(n), left=left, color=colour[n], edgecolor="white")
            ax.text(left + wall(n) / 2, i, f"{n}\n{wall(n):.0f} s", ha="center", va="center", fontsize=7)
            left += wall(n)
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall seconds of the training calls (one H200)")


def _plot_quality_at_sizes(ax: Any, sizes: list[dict[str, Any]]) -> None:
    """Claim 5, right: bits per byte at each specialist's size, one group per size."""
    series = [("shared_bpb", "shared run's tier"), ("specialist_bpb", "specialist"),
              ("recovered_bpb", "dense truncated + recovered"), ("matformer_bpb", "MatFormer tier")]
    width = 0.8 / len(series)
    for j, (key, label) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i, r in enumerate(sizes) if r.get(key) is not None]
        ys = [r[key] for r in sizes if r.get(key) is not None]
        if ys:
            ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(sizes)), [f"{r['tier']} ({r['params'] / 1e6:.1f}M)" for r in sizes])
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("quality at the specialists' sizes", fontsize=10)
    if sizes:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
