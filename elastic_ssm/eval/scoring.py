"""Teacher-forced scoring of continuations, shared by the lm-eval adapter and the needle probe: each row's
``context + continuation[:-1]`` runs through one right-padded causal forward at ``tier``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..config import TierLike

__all__ = ["continuation_scores"]


@torch.no_grad()
def continuation_scores(model: Any, tier: TierLike, contexts: Sequence[list[int]], continuations: Sequence[list[int]],
                        precision: str = "fp32") -> list[tuple[float, list[bool]]]:
    """``[(sum log p(continuation | context), per-token argmax hits)]`` for each row; every context and
    continuation needs at least one token. ``tier`` None runs the model as it is; ``precision="bf16"``
    runs the forward under bf16 autocast."""
    device = next(model.parameters()).device
    rows = [list(c) + list(k[:-1]) for c, k in zip(contexts, continuations)]
    x = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    x = x.to(device)
    with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
        logits = model(x, tier=tier) if tier is not None else model(x)
    out = []
    for i, (c, k) in enumerate(zip(contexts, continuations)):
        lp = F.log_softmax(logits[i, len(c) - 1:len(c) - 1 + len(k)].float(), dim=-1)    # [len(k), V]
        target = torch.tensor(k, device=lp.device)
        out.append((float(lp.gather(-1, target[:, None]).sum()), (lp.argmax(-1) == target).tolist()))
    return out
