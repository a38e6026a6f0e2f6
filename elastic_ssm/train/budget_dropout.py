"""ES-SSM budget-dropout recipe (ES-SSM paper Sec. 4.2, Eq. 5, Algorithm 2) and recipe selection.

Each optimizer step trains the network at one budget K_train, shared by all of the step's
micro-batches on every rank, drawn by ``elastic.budget.BudgetSampler``: the full budget K-bar during
warm-up and on the anchor steps ``step % n_full == 0`` after it, otherwise the log-uniform snapped draw
of Eq. 5. The objective is the plain task loss of the model at K_train,
``L_train = L_task(F_theta(u; K_train), y)`` (next-token CE for ``task='lm'``, class CE for
``task='classify'`` with labels [B]); there is no distillation and no gradient scaling.

The warm-up (Algorithm 2's first phase) is on by default: ``bd_warmup_epochs`` epochs (E_warmup) converted
with the number of optimizer steps per epoch (``len(data) // M``) when set, else ``bd_warmup_steps`` steps
when set, else ``round(bd_warmup_frac x steps)`` (default 0.1; the paper's E_warmup value is not in its
text). ``make_recipe`` picks the recipe of a ``TrainConfig`` for a model ('auto': capacity-mixed for ESSH,
budget dropout for ES-SSM, nested FFN widths for MatFormer (``nested_ffn.py``), dense for a model with a
single tier such as a specialist).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ESSHConfig, ESSSMConfig
from ..elastic.budget import BudgetSampler, warmup_steps_from_epochs
from .capacity_mixed import CapacityMixed, MicroPlan, Recipe, SharedRefinement

__all__ = ["BudgetDropout", "make_recipe", "resolve_recipe_name", "bd_warmup_steps"]


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


def resolve_recipe_name(recipe: str, model: nn.Module) -> str:
    """The concrete recipe of ``recipe`` for ``model``; a recipe that does not fit the model raises."""
    cfg = getattr(model, "config", None)
    if recipe == "auto":   # a model with a single tier (a specialist, a Transformer++) has nothing to mix
        if isinstance(cfg, ESSHConfig) and len(cfg.tier_xi) > 1:
            return "capacity_mixed"
        if isinstance(cfg, ESSSMConfig) and len(cfg.budgets) > 1:
            return "budget_dropout"
        if len(getattr(cfg, "granularities", ())) > 1:
            return "nested_ffn"
        return "dense"
    if recipe == "capacity_mixed" and not isinstance(cfg, ESSHConfig):
        raise ValueError("TrainConfig.recipe='capacity_mixed' is the ESSH recipe (Algorithm 1); the model "
                         f"is {type(model).__name__}: use 'budget_dropout' for ES-SSM or 'dense'")
    if recipe == "budget_dropout" and not isinstance(cfg, ESSSMConfig):
        raise ValueError(f"TrainConfig.recipe='budget_dropout' is the ES-SSM recipe (Sec. 4.2); the model is "
                         f"{type(model).__name__}: use 'capacity_mixed' for ESSH or 'dense'")
    return recipe


def bd_warmup_steps(cfg: Any, data: Any, accum: int | None = None) -> int:
    """Budget-dropout warm-up in steps: ``bd_warmup_epochs`` x steps per epoch (``len(data) // accum``, the
    micro-batches per rank and step; default ``cfg.grad_accum``), else ``bd_warmup_steps``, else
    ``round(bd_warmup_frac x steps)``."""
    if cfg.bd_warmup_epochs <= 0:
        return cfg.bd_warmup_steps or round(cfg.bd_warmup_frac * cfg.steps)
    try:
        per_epoch = len(data) // (accum or cfg.grad_accum)
    except TypeError as e:
        raise ValueError("TrainConfig.bd_warmup_epochs needs data with len() (batches per epoch, e.g. "
                         "PackedBatches); otherwise set bd_warmup_steps") from e
    return warmup_steps_from_epochs(cfg.bd_warmup_epochs, max(1, per_epoch))


def make_recipe(name: str, model: nn.Module, cfg: Any, data: Any = None, accum: int | None = None) -> Recipe:
    """The recipe object of stage ``name`` ('capacity_mixed', 'budget_dropout', 'nested_ffn', 'dense', 'refine');
    ``accum``: micro-batches per rank and step (for an epoch-based budget-dropout warm-up)."""
    mcfg = getattr(model, "config", None)
    if name == "capacity_mixed":
        return CapacityMixed.from_config(mcfg, cfg)
    if name == "refine":
        if not isinstance(mcfg, ESSHConfig):
            raise ValueError("shared refinement (TrainConfig.refine.steps > 0) is defined for ESSH only")
        return SharedRefinement.from_config(mcfg, cfg)
    if name == "budget_dropout":
        sampler = BudgetSampler(mcfg.budgets, mcfg.n_channels, warmup_steps=bd_warmup_steps(cfg, data, accum),
                                n_full=cfg.n_full, seed=cfg.seed)
        return BudgetDropout(sampler)
    if name == "dense":
        return Recipe()
    if name == "posthoc":
        from .posthoc import PosthocRecovery

        return PosthocRecovery.from_config(model, cfg)
    if name == "nested_ffn":
        from .nested_ffn import NestedFFN

        return NestedFFN.from_config(mcfg, cfg)
    raise ValueError(f"unknown recipe {name!r}")
