"""Suite kind ``memory`` (``MemoryOptions``): persistent decoding memory per sequence, the cache tensors a tier
allocates (on ``meta``: nothing is used) against ``elastic.tiers.state_bytes`` (ESSH C.5, Table 53), and the
``2 N context d`` KV entries of the matched Transformer++. Entries of the ``h200`` and ``cpu-smoke`` suites."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_ssm.bench import Peer
from elastic_ssm.config import ConfigBase, ESSHConfig, opt
from elastic_ssm.config.base import AtLeast1
from elastic_ssm.elastic.tiers import state_bytes, tier_table
from elastic_ssm.models.baselines import TransformerConfig

__all__ = ["MemoryOptions", "run_memory", "essh_memory_rows", "transformer_memory_row"]


@dataclass(kw_only=True)
class MemoryOptions(ConfigBase):
    """Which preset's tiers are counted, and against which peer."""

    preset: str = opt("370m", "ESSH preset whose tiers' decode caches are counted (every tier)")
    peers: tuple[Peer, ...] = opt(("transformer",), "peers: transformer adds the matched Transformer++'s KV cache at "
                                  "context (the fla peers have no row)")
    context: AtLeast1 = opt(2048, "tokens in the Transformer++ KV cache")


def essh_memory_rows(cfg: ESSHConfig, tiers=None, batch: int = 1, device: str | torch.device = "meta",
                     state_dtype: torch.dtype = torch.float32,
                     kv_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per tier (default: every tier): measured and formula bytes per sequence at ``batch`` (``match`` must
    be True), the ring buffers' position bookkeeping apart."""
    from elastic_ssm.models.cache import ESSHCache
    from elastic_ssm.models.essh import ESSH

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
            "model": "essh", "tier": name, "batch": batch,
            "recurrent": measured["recurrent"] // batch, "kv": measured["kv"] // batch,
            "total": measured["total"] // batch, "formula_total": formula["total"] // batch,
            "bookkeeping": book // batch, "match": measured == formula,
        })
    return rows


def transformer_memory_row(tcfg: TransformerConfig, context: int, name: str = "transformer",
                           kv_dtype_bytes: int = 2) -> dict:
    """The KV cache of ``tcfg`` at ``context`` tokens (bf16 by default), in the columns of ``essh_memory_rows``."""
    kv = state_bytes(tcfg, None, 1, kv_dtype_bytes=kv_dtype_bytes, context=context)["kv"]
    return {"model": name, "tier": "-", "batch": 1, "recurrent": 0, "kv": kv, "total": kv,
            "formula_total": kv, "bookkeeping": 8, "match": True}


def run_memory(opts: MemoryOptions, ctx) -> list[dict]:
    """Every ESSH tier of ``opts.preset`` (measured == formula) and, with the transformer peer, its KV cache."""
    from elastic_ssm.bench.decode import transformer_matched

    cfg = ESSHConfig.preset(opts.preset)
    rows = essh_memory_rows(cfg)
    if "transformer" in opts.peers:
        rows.append(transformer_memory_row(transformer_matched(cfg)[0], opts.context))
    rows = [{"preset": opts.preset, **r} for r in rows]
    for r in rows:
        ctx.log(f"  {r}")
    return rows
