"""Throughput of ESSH at the preset shapes against the peers: prefill (batch-1 full-logit forwards per prompt length,
ESSH P.2, Table 58: ktok/s and peak GB) and training at full capacity with its MFU (ESSH P.1, Table 50: ``3 F tok/s /
peak``, ``F`` = ``elastic.tiers.flops_per_token`` at ``seq_len``; elementwise work is not counted, so MFU is a lower
bound)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..elastic import tiers
from .decode import built_peer, oom_as_result, peer_forward, peer_model, summarize, time_fn

__all__ = ["bench_prefill", "prefill_suite", "bench_train", "train_suite"]


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


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def bench_train(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], vocab: int,
                flops_per_token: int, device: torch.device, batch: int = 8, seq_len: int = 2048,
                warmup: int = 3, steps: int = 10, peak_tflops: float = 989.0, lr: float = 1e-4,
                compile_loss: bool = False) -> dict:
    """Time optimizer steps of ``model`` (``forward(ids) -> logits``); returns tokens/s, ms/step, MFU.

    ``compile_loss`` compiles the loss (the logits' fp32 cast fuses into the cross-entropy)."""
    row: dict = {"batch": batch, "seq_len": seq_len, "peak_tflops": peak_tflops}
    loss_fn = torch.compile(_loss, dynamic=False) if compile_loss else _loss
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    model.train()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(forward(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        with oom_as_result(row, device, peak=True):
            row.update(summarize(time_fn(step, warmup, steps, device)))
            row["tok_s"] = batch * seq_len / (row["ms"] / 1e3)
            row["mfu"] = 3 * flops_per_token * row["tok_s"] / (peak_tflops * 1e12)
    finally:
        model.eval()
    return row


def train_suite(r, out: list) -> None:
    """ESSH at full capacity (fp32 master weights, bf16 autocast) and, with ``train_peers``, the peers."""
    cfg, dev, V = r.cfg, r.dev, r.mcfg.vocab_size
    kw = dict(batch=cfg.train_batch, seq_len=cfg.train_seq_len, warmup=cfg.train_warmup, steps=cfg.train_steps,
              peak_tflops=cfg.peak_tflops)
    base = {"bench": "train", "model": "essh", "preset": cfg.preset, "tier": r.full, "params": r.table[r.full].params}

    def essh() -> dict:
        model = r.essh(dtype=None)
        fpt = tiers.flops_per_token(r.mcfg, None, context=cfg.train_seq_len)["total"]
        return bench_train(model, model, V, fpt, dev, compile_loss=cfg.compile, **kw)

    r.run(out, {**base, "compiled": cfg.compile}, essh)
    if not cfg.train_peers:
        return
    for peer in cfg.peers:
        def run_peer(peer=peer) -> dict:
            model, _, info = peer_model(r, peer, torch.float32, training=True)
            # fla peers: the dense-layer estimate, 2 FLOPs per parameter and token
            fpt = tiers.flops_per_token(model.config, context=cfg.train_seq_len)["total"] if peer == "transformer" \
                else 2 * info["params"]
            fwd, compiled = peer_forward(model, peer, cfg.compile, cfg.compile_mode)
            return {"params": info["params"], "compiled": compiled,
                    **bench_train(model, fwd, V, fpt, dev, compile_loss=compiled, **kw)}

        r.run(out, {"bench": "train", "model": peer, "preset": cfg.preset, "tier": "-"}, run_peer)
