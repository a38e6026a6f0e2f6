"""Prefill throughput: batch-1 full-logit forwards per prompt length (ESSH P.2, Table 58), ktok/s and peak GB."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .timing import oom_as_result, summarize, time_fn

__all__ = ["bench_prefill", "prefill_suite"]


def bench_prefill(forward: Callable[[torch.Tensor], torch.Tensor], length: int, vocab: int,
                  device: torch.device,
                  warmup: int = 3, iters: int = 5, batch: int = 1) -> dict:
    """Time ``forward(ids [batch, length])``; returns ``{"length", "ms", "ktok_s", "peak_gb", ...}``."""
    row: dict = {"length": length, "batch": batch}
    ids = torch.randint(0, vocab, (batch, length), device=device)
    with oom_as_result(row, device, peak=True):
        with torch.inference_mode():
            times = time_fn(lambda: forward(ids), warmup, iters, device)
        row.update(summarize(times))
        row["ktok_s"] = batch * length / row["ms"]
    return row


def prefill_suite(r, out: list) -> None:
    """ESSH at ``prefill_tiers`` and every peer at every prompt length."""
    from .decode import built_peer
    from .peers import peer_forward

    cfg, dev, V = r.cfg, r.dev, r.mcfg.vocab_size

    def sweep(base: dict, forward: Callable[[torch.Tensor], torch.Tensor], compiled: bool) -> None:
        for T in cfg.prefill_lengths:
            r.run(out, {**base, "length": T, "compiled": compiled}, lambda T=T: bench_prefill(
                forward, T, V, dev, cfg.prefill_warmup, cfg.prefill_iters))

    model = r.essh() if cfg.prefill_tiers else None
    for name in cfg.prefill_tiers:
        sweep({"bench": "prefill", "model": "essh", "preset": cfg.preset, "tier": name,
               "params": r.table[name].params, "full": name == r.full}, lambda ids, name=name: model(ids, tier=name),
              cfg.compile)
    model = None
    for peer in cfg.peers:
        base = {"bench": "prefill", "model": peer, "preset": cfg.preset, "tier": "-"}
        built = built_peer(r, out, {**base, "length": 0}, peer)
        if built is not None:
            sweep({**base, "params": built[2]["params"]}, *peer_forward(built[0], peer, cfg.compile, cfg.compile_mode))
        built = None
