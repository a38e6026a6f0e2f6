"""Measuring the tiers for ``select_tier``: ``tier_profile.json`` (speed) and ``tier_quality.json`` (quality).

``calibrate(model, batches)`` times the served decode path of every tier: a ``SlotPool`` of each batch size
(``serve/slots.py``: the fused decoder, CUDA-graphed on CUDA), ``warmup`` untimed steps, then ``iters``
steps timed with CUDA events (wall clock on the CPU); one step gives every stream of the batch one token,
so the step time is the ms/token each stream sees. Every step reads the whole window ring (no attended span,
``serve/slots.py``): the cost of long sequences, the bound a budget must hold to. It also records the exact
per-sequence state bytes and parameter count of each tier from the config, the device and the library versions.
``write_profile`` / ``write_quality`` write the files into the model directory atomically;
``quality_table(rows, ...)`` turns ``elastic-ssm eval``'s rows into the quality file's table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..elastic.tiers import state_bytes
from ..utils.files import atomic_write_bytes
from .select import PROFILE_FILE, QUALITY_FILE
from .slots import SlotPool

__all__ = ["calibrate", "write_profile", "write_quality", "quality_table"]


def _step_ms(pool: SlotPool, warmup: int, iters: int) -> float:
    tokens = torch.zeros(pool.slots, dtype=torch.long, device=pool.device)
    for _ in range(warmup):
        pool.step(tokens)
    if pool.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(pool.device)
        start.record()
        for _ in range(iters):
            pool.step(tokens)
        end.record()
        torch.cuda.synchronize(pool.device)
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        pool.step(tokens)
    return (time.perf_counter() - t) * 1e3 / iters


def calibrate(model, batches: list[int], tiers: list[str] | None = None, warmup: int = 5, iters: int = 20,
              progress=print) -> dict:
    """The profile table (the ``tier_profile.json`` format; see the module docstring)."""
    from ..bench.report import environment

    device = model.embed.weight.device
    names = tiers or [t.name for t in model.tier_table()]
    env = environment(device, command=None)
    out = {"device": env["device"], "torch": env["torch"], "triton": env["triton"], "cuda": env["cuda"],
           "dtype": str(model.embed.weight.dtype).replace("torch.", ""), "commit": env["commit"],
           "date": env["date"], "warmup": warmup, "iters": iters, "tiers": {}}
    for name in names:
        t = model.resolve_tier(name)
        row = {"ms_per_token": {}, "state_bytes": state_bytes(model.config, t)["total"], "params": t.params}
        for b in batches:
            pool = SlotPool(model, t, b, spans=False)     # the whole ring every step: the long-context cost
            row["ms_per_token"][str(b)] = round(_step_ms(pool, warmup, iters), 5)
            del pool
            progress(f"  {name} batch {b}: {row['ms_per_token'][str(b)]:.3f} ms/token")
        out["tiers"][name] = row
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _write(path: str | Path, name: str, table: dict) -> Path:
    target = Path(path) / name
    atomic_write_bytes(target, (json.dumps(table, indent=1) + "\n").encode())
    return target


def write_profile(path: str | Path, profile: dict) -> Path:
    """Write ``tier_profile.json`` into the model directory ``path``."""
    return _write(path, PROFILE_FILE, profile)


def quality_table(rows, data: str, split: str, metric: str = "bpb") -> dict:
    """``tier_quality.json``'s table from ``evaluate_tiers`` rows (``TierEval``); lower is better for
    ``bpb`` / ``loss`` / ``perplexity``, higher for ``accuracy``."""
    if metric not in ("bpb", "loss", "perplexity", "accuracy"):
        raise ValueError(f"metric must be bpb, loss, perplexity or accuracy, got {metric!r}")
    tiers = {}
    for r in rows:
        d = r.row()
        tiers[d["tier"]] = {"value": d[metric], "loss": d["loss"], "tokens": d["tokens"], "params": d["params"]}
    return {"data": data, "split": split, "metric": metric, "higher_is_better": metric == "accuracy",
            "tiers": tiers}


def write_quality(path: str | Path, table: dict) -> Path:
    """Write ``tier_quality.json`` into the model directory ``path`` (merging tiers already recorded for the
    same data, split and metric)."""
    target = Path(path) / QUALITY_FILE
    if target.is_file():
        try:
            old = json.loads(target.read_text())
        except json.JSONDecodeError:
            old = None
        if isinstance(old, dict) and all(old.get(k) == table[k] for k in ("data", "split", "metric")):
            table = {**table, "tiers": {**(old.get("tiers") or {}), **table["tiers"]}}
    return _write(path, QUALITY_FILE, table)
