"""Prefill throughput: batch-1 full-logit forwards per prompt length (ESSH P.2, Table 58), ktok/s and peak GB;
the ``session_prefill`` kind: ``generate``'s own prefill (eager or graphed) per scan backend and length."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from annotated_types import Len

from ..config import ConfigBase, opt
from ..config.base import AtLeast1
from .timing import oom_as_result, summarize, time_fn, wall_ms

#: ELASTIC_SSM_SCAN_BACKEND values a bench entry may set
ScanBackend = Literal["auto", "fla", "torch"]

__all__ = ["bench_prefill", "SessionPrefillOptions", "run_session_prefill"]


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
    from .decode import peer_model
    from .peers import build_essh, peer_forward

    cfg, dev, V = r.cfg, r.dev, r.mcfg.vocab_size
    model = build_essh(r.mcfg, dev, r.dtype) if cfg.prefill_tiers else None
    if model is not None and cfg.compile:
        from ..models import compile_model

        compile_model(model, mode=cfg.compile_mode)
    for name in cfg.prefill_tiers:
        for T in cfg.prefill_lengths:
            base = {"bench": "prefill", "model": "essh", "preset": cfg.preset, "tier": name,
                    "params": r.table[name].params, "full": name == r.full, "length": T,
                    "compiled": cfg.compile}
            fwd = lambda ids, name=name: model(ids, tier=name)
            r.run(out, base, lambda fwd=fwd, T=T: bench_prefill(fwd, T, V, dev, cfg.prefill_warmup,
                                                                cfg.prefill_iters))
    model = None
    for peer in cfg.peers:
        holder: dict = {}

        def build(peer=peer, holder=holder) -> dict:
            m, _, info = peer_model(r, peer)
            holder["m"], holder["compiled"] = peer_forward(m, peer, cfg.compile, cfg.compile_mode)
            holder["params"] = info["params"]
            return {"params": info["params"]}

        base = {"bench": "prefill", "model": peer, "preset": cfg.preset, "tier": "-"}
        r.run(out, {**base, "length": 0}, build)
        if "m" not in holder:
            continue
        for T in cfg.prefill_lengths:
            row = {**base, "params": holder["params"], "length": T, "compiled": holder["compiled"]}
            r.run(out, row, lambda T=T, m=holder["m"]: bench_prefill(m, T, V, dev, cfg.prefill_warmup,
                                                                     cfg.prefill_iters))
        holder.clear()


@dataclass(kw_only=True)
class SessionPrefillOptions(ConfigBase):
    """``generate``'s own prefill, timed per scan backend and prompt length (random weights)."""

    preset: str = opt("1.5b", "ESSH preset (random weights)")
    tier: str = opt("T10", "tier of the pooled decoder")
    lengths: Annotated[tuple[AtLeast1, ...], Len(1)] = opt((2048, 131072), "prompt lengths (batch 1)")
    compile: bool = opt(False, "compile_model first: on CUDA the prefill replays the graph of the compiled trunk")
    scan_backends: tuple[ScanBackend, ...] = opt(("auto",), "ELASTIC_SSM_SCAN_BACKEND of each pass: auto (as the "
                                                    "environment says), fla, torch")
    repeats: AtLeast1 = opt(5, "timed prefills per length after the first (median)")
    device: str = opt("auto", "auto (cuda if available), cuda, cpu")



def run_session_prefill(opts: SessionPrefillOptions, ctx) -> list[dict]:
    """Rows ``{"backend", "compiled", "length", "first_call_s", "ms", "ktok_s", "generate_1_ms"}``
    (``generate_1_ms``: the median wall of ``model.generate(prompt, 1)``, the user's call around this prefill)."""
    from ..config import ESSHConfig
    from ..models import compile_model
    from ..models.decode_engine import FusedSession
    from ..ops.dispatch import ENV_VAR
    from .peers import build_essh

    dev = torch.device(opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_essh(ESSHConfig.preset(opts.preset), dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if opts.compile:
        compile_model(model)
    rows, before = [], os.environ.get(ENV_VAR)
    try:
        for backend in opts.scan_backends:
            if backend != "auto":
                os.environ[ENV_VAR] = backend
            for T in opts.lengths:
                if ctx.time_left() <= 0:
                    rows.append({"backend": backend, "length": T, "error": "skipped: time budget"})
                    continue
                row: dict = {"backend": backend, "compiled": opts.compile, "length": T}
                ids = torch.randint(0, model.config.vocab_size, (1, T), device=dev)
                with oom_as_result(row, dev, peak=True), torch.no_grad():
                    session = FusedSession(model, 1, opts.tier, None, None)
                    call = lambda s=session, x=ids: s.prefill(x, None)
                    row["first_call_s"] = wall_ms(call, dev) / 1e3
                    row["ms"] = summarize(time_fn(call, 0, opts.repeats, dev))["ms"]
                    row["ktok_s"] = T / row["ms"]
                    gen = lambda x=ids: model.generate(x, 1, tier=opts.tier)
                    row["generate_1_ms"] = summarize(time_fn(gen, 0, opts.repeats, dev))["ms"]
                ctx.log(f"  prefill {opts.preset} {opts.tier} {backend} compiled={opts.compile} T={T}: {row}")
                rows.append(row)
                model.clear_decoders()
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
    return rows
