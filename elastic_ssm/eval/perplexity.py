"""Per-tier held-out loss, perplexity and bits-per-byte of one shared model (or of exports).

``evaluate_tiers`` runs the shared model at every requested tier on the same fixed batches
(ESSH E.4: same inputs, same evaluator for every tier) and returns one ``TierEval`` per tier.
Bits per byte = loss_nats / ln 2 / bytes_per_token (1 for the byte tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class TierEval:
    tier: str
    K: int
    n_ff: int
    params: int
    loss: float          # mean next-token cross-entropy in nats
    tokens: int
    bytes_per_token: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bpb(self) -> float:
        return self.loss / math.log(2) / self.bytes_per_token

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity, "bpb": self.bpb}


@torch.no_grad()
def evaluate_tiers(model: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], tiers: Iterable[Any] | None = None,
                   bytes_per_token: float = 1.0, autocast_dtype: torch.dtype | None = None) -> list[TierEval]:
    """Mean CE of ``model(x, tier=t)`` over ``batches`` of (input_ids [B,T], labels [B,T], -100 ignored)."""
    tiers = [model.resolve_tier(t) for t in (tiers if tiers is not None else model.tier_table())]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for t in tiers:
            total, count = 0.0, 0
            for x, y in batches:
                x, y = x.to(device), y.to(device)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logits = model(x, tier=t)
                total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                                         reduction="sum").item()
                count += int((y != -100).sum())
            if count == 0:
                raise ValueError("evaluation batches contain no scored tokens")
            out.append(TierEval(t.name, t.K, t.n_ff, t.params, total / count, count, bytes_per_token))
    finally:
        model.train(was_training)
    return out


def format_evals(rows: Sequence[TierEval]) -> str:
    head = f"{'tier':<8}{'K':>4}{'n_ff':>7}{'params':>14}{'loss':>9}{'ppl':>10}{'bpb':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.tier:<8}{r.K:>4}{r.n_ff:>7}{r.params:>14,}{r.loss:>9.4f}{r.perplexity:>10.3f}{r.bpb:>8.4f}")
    return "\n".join(lines)
