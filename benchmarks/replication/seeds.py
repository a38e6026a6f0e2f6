"""Seeds of the replication runs: each arm's mean, min, max and n per tier over its seeds (``seed_stats``), the
same-seed gap between two arms (``paired_gaps``), and claim 1's summary of both (``claim1_summary``, the gaps of
``CLAIM1_GAPS``). A run folder ``<arm>-s<seed>`` is one seed of ``<arm>`` (``claims.arm_of``, ``claims.seed_of``)."""

from __future__ import annotations

from typing import Any

__all__ = ["CLAIM1_GAPS", "claim1_summary", "paired_gaps", "seed_stats"]


def seed_stats(rows: list[dict[str, Any]], key: str = "bpb") -> dict[str, dict[str, dict[str, Any]]]:
    """``{arm: {tier: {n, mean, min, max, seeds}}}`` of ``key`` over the seeds of each arm's runs (``<arm>-s<seed>``;
    a folder without a seed counts as one run); ``seeds`` maps each run to its value."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get(key) is not None:
            out.setdefault(r["arm"], {}).setdefault(str(r["tier"]), {"seeds": {}})["seeds"][r["run"]] = r[key]
    for tiers in out.values():
        for cell in tiers.values():
            v = list(cell["seeds"].values())
            cell.update(n=len(v), mean=sum(v) / len(v), min=min(v), max=max(v))
    return out


def paired_gaps(rows: list[dict[str, Any]], arm: str, other: str, tier: str, other_tier: str | None = None,
                key: str = "bpb") -> dict[int, float]:
    """``{seed: arm - other}`` of ``key`` at ``tier`` (``other_tier`` for ``other``), for the seeds both arms ran.
    A recovered run (``source`` set) is paired with the very run it started from when that run is of ``other``'s
    arm family (``dense-s0-retrain`` for ``dense-rec-s0``), else with ``other``'s run of its seed."""
    ot = other_tier or tier
    val = {(r["arm"], r["seed"], str(r["tier"])): r[key] for r in rows if r.get(key) is not None}
    by_run = {(r["run"], str(r["tier"])): r[key] for r in rows if r.get(key) is not None}
    out = {}
    for r in sorted((r for r in rows if r["arm"] == arm and str(r["tier"]) == tier and r["seed"] is not None
                     and r.get(key) is not None), key=lambda r: r["seed"]):
        src = r.get("source")
        if src and src.startswith(other + "-") and (src, ot) in by_run:
            out[r["seed"]] = r[key] - by_run[(src, ot)]
        elif (other, r["seed"], ot) in val:
            out[r["seed"]] = r[key] - val[(other, r["seed"], ot)]
    return out


#: claim 1's paired gaps (same seed): name -> (arm, tier, other arm, other's tier); a specialist's only tier is T1
CLAIM1_GAPS = {"T1 shared - specialist": ("essh", "T1", "spec-t1", "T1"),
               "T4 shared - specialist": ("essh", "T4", "spec-t4", "T1"),
               "T10 shared - dense": ("essh", "T10", "dense", "T10"),
               "T1 recovered (#16) - shared": ("dense-rec33", "T1", "essh", "T1"),
               "T1 recovered (paper's share) - shared": ("dense-rec", "T1", "essh", "T1"),
               "T4 recovered (#16) - shared": ("dense-rec33", "T4", "essh", "T4"),
               "T4 recovered (paper's share) - shared": ("dense-rec", "T4", "essh", "T4"),
               "T10 recovered (#16) - dense": ("dense-rec33", "T10", "dense", "T10"),
               "T10 recovered (paper's share) - dense": ("dense-rec", "T10", "dense", "T10")}


def claim1_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    gaps = {}
    for name, (a, t, b, bt) in CLAIM1_GAPS.items():
        g = paired_gaps(rows, a, b, t, bt)
        gaps[name] = {"seeds": g, "n": len(g), "mean": sum(g.values()) / len(g) if g else None,
                      "min": min(g.values(), default=None), "max": max(g.values(), default=None),
                      "sign_resolved": bool(g) and len(g) > 1 and (min(g.values()) > 0 or max(g.values()) < 0)}
    return {"seeds": seed_stats(rows), "gaps": gaps}
