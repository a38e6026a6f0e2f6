"""ES-SSM budget-dropout recipe (ES-SSM paper Sec. 4.2, Eq. 5, Algorithm 2) and recipe selection.

Each optimizer step trains the network at one budget K_train, shared by all of the step's
micro-batches on every rank, drawn by ``elastic.budget.BudgetSampler``: the full budget K-bar during
warm-up and on the anchor steps ``step % n_full == 0`` after it, otherwise the log-uniform snapped draw
of Eq. 5. The objective is the plain task loss of the model at K_train,
``L_train = L_task(F_theta(u; K_train), y)`` (next-token CE for ``task='lm'``, class CE for
``task='classify'`` with labels [B]); there is no distillation and no gradient scaling.

The warm-up (Algorithm 2's first phase, ``TrainConfig.budget_dropout``) is on by default: ``warmup_epochs``
epochs (E_warmup) converted with the number of optimizer steps per epoch (``len(data) // M``) when set, else
``warmup_steps`` steps when set, else ``round(warmup_frac x steps)`` (default 0.1; the paper's E_warmup value
is not in its text). ``make_recipe`` picks the recipe of a ``TrainConfig`` for a model ('auto': the model
config's ``default_recipe()``: capacity-mixed for ESSH, budget dropout for ES-SSM, nested FFN widths for
MatFormer (``nested_ffn.py``), dense for a model with a single tier such as a specialist); a recipe that
needs an architecture is refused for the others (``ModelConfig.elastic_recipes``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelConfig
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
    own = cfg.elastic_recipes if isinstance(cfg, ModelConfig) else ()
    if recipe == "auto":   # a model with a single tier (a specialist, a Transformer++) has nothing to mix
        return cfg.default_recipe() if isinstance(cfg, ModelConfig) else "dense"
    if recipe in _NEEDS and recipe not in own:
        raise ValueError(f"TrainConfig.recipe={recipe!r} is {_NEEDS[recipe]}; the model is {type(model).__name__}: "
                         f"use 'auto' (for this model {resolve_recipe_name('auto', model)!r}) or 'dense'")
    return recipe


#: recipes defined for one architecture only (``ModelConfig.elastic_recipes`` says which a config takes)
_NEEDS = {"capacity_mixed": "the ESSH recipe (Algorithm 1)", "budget_dropout": "the ES-SSM recipe (Sec. 4.2)",
          "refine": "shared refinement of ESSH (D.8)"}


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


def make_recipe(name: str, model: nn.Module, cfg: Any, data: Any = None, accum: int | None = None) -> Recipe:
    """The recipe object of stage ``name`` ('capacity_mixed', 'budget_dropout', 'nested_ffn', 'dense', 'refine');
    ``accum``: micro-batches per rank and step (for an epoch-based budget-dropout warm-up)."""
    mcfg = getattr(model, "config", None)
    if name == "capacity_mixed":
        return CapacityMixed.from_config(mcfg, cfg)
    if name == "refine":
        if "refine" not in getattr(mcfg, "elastic_recipes", ()):
            raise ValueError("shared refinement (TrainConfig.refine.steps > 0) is defined for ESSH only")
        return SharedRefinement.from_config(mcfg, cfg)
    if name == "budget_dropout":
        sampler = BudgetSampler(mcfg.budgets, mcfg.n_channels, warmup_steps=bd_warmup_steps(cfg, data, accum),
                                n_full=cfg.budget_dropout.n_full, seed=cfg.seed)
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
