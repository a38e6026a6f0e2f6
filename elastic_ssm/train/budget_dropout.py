"""ES-SSM budget dropout (ES-SSM Sec. 4.2, Eq. 5, Algorithm 2): every step trains at one budget K_train for all its
micro-batches on every rank (``elastic.budget.BudgetSampler``: the full budget during warm-up and on the anchor steps
``step % n_full == 0``, else the log-uniform snapped draw of Eq. 5), with the plain task loss
``L_task(F_theta(u; K_train), y)``. Warm-up: ``warmup_epochs`` x steps per epoch, else ``warmup_steps``, else
``round(warmup_frac x steps)`` (the paper's E_warmup value is not in its text)."""

from __future__ import annotations

from typing import Any

from ..elastic.budget import BudgetSampler, warmup_steps_from_epochs
from .capacity_mixed import MicroPlan, Recipe

__all__ = ["BudgetDropout", "bd_warmup_steps"]


class BudgetDropout(Recipe):
    """One sampled budget per step (Eq. 5) with warm-up and full-budget anchors."""

    name = "budget_dropout"

    def __init__(self, sampler: BudgetSampler) -> None:
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.sampler.state_dict()}

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        K = self.sampler.sample(step)
        return [MicroPlan(tier=K, label=K) for _ in range(n_global)]


def bd_warmup_steps(cfg: Any, data: Any, accum: int | None = None) -> int:
    """Budget-dropout warm-up in steps (``cfg.budget_dropout``): ``warmup_epochs`` x steps per epoch
    (``len(data) // accum``, the micro-batches per rank and step; default ``cfg.grad_accum``), else
    ``warmup_steps``, else ``round(warmup_frac x steps)``."""
    bd = cfg.budget_dropout
    if bd.warmup_epochs <= 0:
        return bd.warmup_steps or round(bd.warmup_frac * cfg.steps)
    try:
        per_epoch = len(data) // (accum or cfg.grad_accum)
    except TypeError as e:
        raise ValueError("TrainConfig.budget_dropout.warmup_epochs needs data with len() (batches per epoch, e.g. "
                         "PackedBatches); otherwise set budget_dropout.warmup_steps") from e
    return warmup_steps_from_epochs(bd.warmup_epochs, max(1, per_epoch))
