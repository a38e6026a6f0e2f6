"""The records ``select_tier`` reads, ``tier_profile.json`` (ms/token per tier and batch) and ``tier_quality.json``
(``eval``), written atomically, merged into a comparable saved record or renamed aside (docs/serving.md)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..elastic.tiers import state_bytes
from ..utils.files import atomic_write_bytes, free_stamped_path, read_json
from .select import PROFILE_FILE, QUALITY_FILE
from .slots import SlotPool

__all__ = ["calibrate", "write_profile", "write_quality", "quality_table", "PROFILE_KEYS", "QUALITY_KEYS"]

# the settings that make two records' numbers comparable (a merge needs them equal)
PROFILE_KEYS = ("device", "dtype", "torch", "triton", "cuda")
QUALITY_KEYS = ("metric", "data", "split", "seq_len", "window", "batch_size", "n_batches", "tokenizer",
                "bytes_per_token", "device", "dtype")


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
              progress=print, show_progress: bool = False) -> dict:
    """``tier_profile.json``'s table: ms per served decode step of each tier in a ``SlotPool`` of each batch, reading
    the whole window ring (the long-context bound); ``progress``: a line per entry, ``show_progress``: a bar."""
    from ..utils.environment import environment
    from ..utils.progress import progress as progress_bar

    device = model.embed.weight.device
    names = tiers or [t.name for t in model.tier_table()]
    env = environment(device, command=None)
    out = {"device": env["device"], "torch": env["torch"], "triton": env["triton"], "cuda": env["cuda"],
           "dtype": str(model.embed.weight.dtype).replace("torch.", ""), "commit": env["commit"],
           "date": env["date"], "warmup": warmup, "iters": iters, "tiers": {}}
    bar = progress_bar(desc="calibrate", total=len(names) * len(batches), enabled=show_progress, unit="entry")
    for name in names:
        t = model.resolve_tier(name)
        row = {"ms_per_token": {}, "state_bytes": state_bytes(model.config, t)["total"], "params": t.params}
        for b in batches:
            pool = SlotPool(model, t, b, spans=False)     # the whole ring every step: the long-context cost
            row["ms_per_token"][str(b)] = round(_step_ms(pool, warmup, iters), 5)
            del pool
            bar.update()
            progress(f"  {name} batch {b}: {row['ms_per_token'][str(b)]:.3f} ms/token")
        row["date"] = out["date"]
        out["tiers"][name] = row
    bar.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _tier_names(names) -> str:
    names = sorted(names, key=lambda n: (len(n), n))      # T2 before T10
    if len(names) > 4:
        return f"{names[0]}..{names[-1]}, {len(names)} tiers"
    return ",".join(names) if names else "no tiers"


def _not_comparable(old, new: dict, keys: tuple[str, ...]) -> str | None:
    """Why the saved record ``old`` cannot be merged with ``new`` (None: it can)."""
    if not isinstance(old, dict) or not isinstance(old.get("tiers"), dict):
        return "it is not a readable record"
    absent = [k for k in keys if k not in old and new.get(k) is not None]
    diffs = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if k not in absent and old.get(k) != new.get(k)]
    if absent:
        diffs.append(f"it does not record {', '.join(absent)}")
    for tier, row in new["tiers"].items():
        was = old["tiers"].get(tier)
        if isinstance(was, dict) and isinstance(row, dict) and was.get("params") != row.get("params"):
            diffs.append(f"{tier} params {was.get('params')} -> {row.get('params')} (another model)")
            break
    return "; ".join(diffs) or None


def _merge_write(path: str | Path, name: str, table: dict, keys: tuple[str, ...], merge_rows: Callable,
                 notice: Callable[[str], None] | None) -> Path:
    """Write ``table`` as ``path/name``, merged into the saved record when comparable, else beside it."""
    target = Path(path) / name
    if target.is_file():
        old = read_json(target)
        why = _not_comparable(old, table, keys)
        if why is None:
            tiers = dict(old["tiers"])
            for tier, row in table["tiers"].items():
                tiers[tier] = merge_rows(tiers.get(tier), row)
            table = {**table, "tiers": tiers}
        else:
            dest = free_stamped_path(target.parent, f"{target.stem}.replaced-", ".json")
            os.replace(target, dest)
            saved = old.get("tiers") if isinstance(old, dict) else None
            saved = [str(t) for t in saved] if isinstance(saved, dict) else []
            (notice or functools.partial(print, file=sys.stderr))(
                f"{target}: the saved record ({_tier_names(saved)}) is not comparable with this one ({why}); kept it "
                f"as {dest.name}, and {name} now holds {_tier_names(list(table['tiers']))} only")
    atomic_write_bytes(target, (json.dumps(table, indent=1) + "\n").encode())
    return target


def _merge_profile_row(old, new: dict) -> dict:
    if not isinstance(old, dict) or not isinstance(old.get("ms_per_token"), dict):
        return new
    return {**old, **new, "ms_per_token": {**old["ms_per_token"], **new["ms_per_token"]}}


def write_profile(path: str | Path, profile: dict, notice: Callable[[str], None] | None = None) -> Path:
    """Write ``tier_profile.json`` into the model directory ``path`` (``notice``: stderr)."""
    return _merge_write(path, PROFILE_FILE, profile, PROFILE_KEYS, _merge_profile_row, notice)


def quality_table(rows, data: str, split: str, metric: str = "bpb", **settings) -> dict:
    """``tier_quality.json``'s table from ``evaluate_tiers`` rows (``metric``: one of ``eval --quality_metric``'s
    choices; higher is better for ``accuracy`` only); ``settings``: the ``QUALITY_KEYS`` the rows do not give."""
    unknown = set(settings) - set(QUALITY_KEYS)
    if unknown:
        raise ValueError(f"unknown quality settings {sorted(unknown)}; known: {', '.join(QUALITY_KEYS)}")
    rows, tiers = list(rows), {}
    for r in rows:
        d = r.row()
        tiers[d["tier"]] = {"value": d[metric], "loss": d["loss"], "tokens": d["tokens"], "params": d["params"]}
    def same(field: str):     # the rows' common value (None when they differ)
        values = {getattr(r, field) for r in rows}
        return values.pop() if len(values) == 1 else None

    return {"data": data, "split": split, "metric": metric, "higher_is_better": metric == "accuracy",
            "seq_len": same("seq_len"), "bytes_per_token": same("bytes_per_token"), **settings, "tiers": tiers}


def write_quality(path: str | Path, table: dict, notice: Callable[[str], None] | None = None) -> Path:
    """Write ``tier_quality.json`` into the model directory ``path`` (``notice``: stderr)."""
    return _merge_write(path, QUALITY_FILE, table, QUALITY_KEYS, lambda old, new: new, notice)
