"""The user's generation path: ``model.generate`` timed per tier and batch (first call, prefill, ms/token, the
decoder's own step)."""

from __future__ import annotations

import torch

from .timing import oom_as_result, summarize, time_fn, wall_ms

__all__ = ["bench_generate", "generate_suite"]


def bench_generate(model, tier: str, batch: int, prompt_len: int, new_tokens: int, iters: int,
                   device: torch.device) -> dict:
    """One entry: ``first_call_s`` (decoder build, graph capture, compilation), ``prefill_ms`` (``max_new_tokens=1``),
    ``total_ms``, ``ms_per_token`` = (total - prefill) / (new tokens - 1), ``step_ms`` (the pooled decoder's step)
    and their ``ratio``; medians over ``iters`` calls after one warm-up call."""
    from ..models.decode_engine import decoder_pool

    if new_tokens < 2:
        raise ValueError("generate_new_tokens must be >= 2 (the per-token figure needs two or more)")
    row: dict = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    with oom_as_result(row, device, peak=True):
        row["first_call_s"] = wall_ms(lambda: model.generate(ids, 2, tier=tier), device) / 1e3
        model.generate(ids, new_tokens, tier=tier)                     # warm: every graph exists now
        pre = [wall_ms(lambda: model.generate(ids, 1, tier=tier), device) for _ in range(iters)]
        tot = [wall_ms(lambda: model.generate(ids, new_tokens, tier=tier), device) for _ in range(iters)]
        row["prefill_ms"] = summarize(pre)["ms"]
        row["prefill_ktok_s"] = batch * prompt_len / row["prefill_ms"]
        row["total_ms"] = summarize(tot)["ms"]
        row["ms_per_token"] = (row["total_ms"] - row["prefill_ms"]) / (new_tokens - 1)
        fd = decoder_pool(model).get(tier, batch)
        row["graphed"] = fd.graphed
        tok = torch.zeros(batch, dtype=torch.long, device=device)
        with torch.inference_mode():
            row["step_ms"] = summarize(time_fn(lambda: fd.step(tok), 20, 100, device))["ms"]
        row["ratio"] = row["ms_per_token"] / row["step_ms"]
    return row


def generate_suite(r, out: list) -> None:
    """Every (tier, batch) of the config through ``model.generate`` (compiled when ``compile`` is set)."""
    cfg, dev = r.cfg, r.dev
    model = r.essh()
    for name in cfg.generate_tiers:
        for batch in cfg.generate_batches:
            base = {"bench": "generate", "model": "essh", "preset": cfg.preset, "tier": name,
                    "params": r.table[name].params, "compiled": cfg.compile}
            r.run(out, base, lambda name=name, batch=batch: bench_generate(
                model, name, batch, cfg.generate_prompt, cfg.generate_new_tokens, cfg.generate_iters, dev))
    model.clear_decoders()
