"""Recipe selection: ``resolve_recipe_name`` ('auto' is the model config's ``default_recipe()``; a recipe of another
architecture is refused) and ``make_recipe``, the one place that builds every recipe of a stage."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelConfig
from ..elastic.budget import BudgetSampler
from .budget_dropout import BudgetDropout, bd_warmup_steps
from .capacity_mixed import CapacityMixed, Recipe, SharedRefinement
from .nested_ffn import NestedFFN
from .posthoc import PosthocRecovery

__all__ = ["make_recipe", "resolve_recipe_name"]


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


def make_recipe(name: str, model: nn.Module, cfg: Any, data: Any = None, accum: int | None = None) -> Recipe:
    """The recipe object of stage ``name`` ('capacity_mixed', 'budget_dropout', 'nested_ffn', 'dense', 'refine');
    ``accum``: micro-batches per rank and step (for an epoch-based budget-dropout warm-up)."""
    mcfg = getattr(model, "config", None)
    if name == "capacity_mixed":
        return CapacityMixed(mcfg, cfg)
    if name == "refine":
        if "refine" not in getattr(mcfg, "elastic_recipes", ()):
            raise ValueError("shared refinement (TrainConfig.refine.steps > 0) is defined for ESSH only")
        return SharedRefinement(mcfg, cfg)
    if name == "budget_dropout":
        sampler = BudgetSampler(mcfg.budgets, mcfg.n_channels, warmup_steps=bd_warmup_steps(cfg, data, accum),
                                n_full=cfg.budget_dropout.n_full, seed=cfg.seed)
        return BudgetDropout(sampler)
    if name == "dense":
        return Recipe()
    if name == "posthoc":
        return PosthocRecovery(model, cfg)
    if name == "nested_ffn":
        return NestedFFN(mcfg, cfg)
    raise ValueError(f"unknown recipe {name!r}")
