"""Cached autoregressive generation for ESSH (prefill with the chunked scan, decode with the step).

``generate`` accepts a left-padded batch (``attention_mask`` [B, T], 1 = real token). Padded positions
never enter a recurrent state (their write gate is zeroed) and are masked as attention keys, so every
row equals the unpadded single-sequence result. Sampling: greedy (temperature 0), temperature, top-k,
top-p; ``eos`` stops a row (it then emits ``pad`` = eos); ``streamer(tokens [B])`` is called per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, idx = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p          # keep the smallest set with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_left_padding(mask: torch.Tensor) -> None:
    m = mask.long()
    if (m[:, 1:] < m[:, :-1]).any():
        raise ValueError("attention_mask must use LEFT padding (zeros before the real tokens of each row)")
    if (m.sum(1) == 0).any():
        raise ValueError("every row needs at least one real token (attention_mask row of zeros)")


class GenerationMixin:
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, tier: Any = None,
                 attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos: int | None = None,
                 streamer: Callable[[torch.Tensor], None] | None = None,
                 generator: torch.Generator | None = None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return ``input_ids`` followed by ``max_new_tokens`` sampled tokens, [B, T + new].

        Caches default to fp32 states and a bf16 KV ring on CUDA, and to the parameter dtype on CPU.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError("attention_mask must have the shape of input_ids")
            _check_left_padding(attention_mask)
        was_training = self.training
        self.eval()
        eos = self.config.eos_token_id if eos is None and self.config.eos_token_id >= 0 else eos
        B = input_ids.shape[0]
        cache = self.allocate_cache(B, tier, state_dtype=state_dtype, kv_dtype=kv_dtype)
        logits = self(input_ids, tier=tier, attention_mask=attention_mask, cache=cache)[:, -1]
        out = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        try:
            for _ in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, top_p, generator)
                if eos is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    done |= nxt == eos
                out.append(nxt[:, None])
                if streamer is not None:
                    streamer(nxt)
                if eos is not None and bool(done.all()):
                    break
                logits = self.step(nxt, cache)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)
