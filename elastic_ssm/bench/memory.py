"""Persistent decoding memory per sequence: the cache tensors a tier allocates (on ``meta``) against
``elastic.tiers.state_bytes`` (ESSH C.5, Table 53); Transformer++ keeps ``2 N context d`` KV entries."""

from __future__ import annotations

import torch

from ..config import ESSHConfig
from ..elastic.tiers import state_bytes, tier_table
from ..models.baselines import TransformerConfig

__all__ = ["essh_memory_rows", "transformer_memory_row", "memory_suite"]


def essh_memory_rows(cfg: ESSHConfig, tiers=None, batch: int = 1, device: str | torch.device = "meta",
                     state_dtype: torch.dtype = torch.float32,
                     kv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per tier: measured and formula bytes per sequence at ``batch`` (``match`` must be True)."""
    from ..models.cache import ESSHCache
    from ..models.essh import ESSH

    device = torch.device(device)
    with torch.device("meta"):
        shape = ESSH(cfg)          # no weights are materialised: only the layers' init_state is used
    names = [t.name for t in tier_table(cfg)] if tiers is None else list(tiers)
    rows = []
    for name in names:
        cache = ESSHCache.allocate(shape, batch, name, device=device,
                                   state_dtype=state_dtype, kv_dtype=kv_dtype)
        measured = cache.nbytes()
        formula = state_bytes(cfg, name, batch=batch, state_dtype_bytes=state_dtype.itemsize,
                              kv_dtype_bytes=kv_dtype.itemsize)
        book = sum(r.slot_pos.numel() * 8 for r in cache.rings.values()) + cache.positions.numel() * 8
        rows.append({
            "bench": "memory", "model": "essh", "tier": name, "batch": batch,
            "recurrent": measured["recurrent"] // batch, "kv": measured["kv"] // batch,
            "total": measured["total"] // batch, "formula_total": formula["total"] // batch,
            "bookkeeping": book // batch, "match": measured == formula,
        })
    return rows


def transformer_memory_row(tcfg: TransformerConfig, context: int, name: str = "transformer++",
                           kv_dtype_bytes: int = 2) -> dict:
    kv = tcfg.kv_bytes(context, 1, kv_dtype_bytes)
    return {"bench": "memory", "model": name, "tier": "-", "batch": 1, "recurrent": 0, "kv": kv, "total": kv,
            "formula_total": kv, "bookkeeping": 8, "match": True}


def memory_suite(r, out: list) -> None:
    """Every ESSH tier (measured == formula) and the Transformer++ KV cache at ``context``."""
    from .peers import transformer_matched

    for name in r.table:
        base = {"bench": "memory", "model": "essh", "preset": r.cfg.preset, "tier": name}
        r.run(out, base, lambda name=name: essh_memory_rows(r.mcfg, [name])[0])
    if "transformer" in r.cfg.peers:
        base = {"bench": "memory", "model": "transformer", "preset": r.cfg.preset}
        tcfg = transformer_matched(r.mcfg)[0]
        r.run(out, base, lambda: transformer_memory_row(tcfg, r.cfg.context, "transformer"))
