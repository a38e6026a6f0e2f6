"""The recipes of one file each too small to stand alone, and recipe selection: ``BudgetDropout`` (ES-SSM),
``NestedFFN`` (MatFormer), ``PosthocRecovery`` (E.7's recovery under a frozen parent, ``recover.py``),
``resolve_recipe_name`` ('auto' is the model config's ``default_recipe()``; a recipe of
another architecture is refused) and ``make_recipe``, the one place that builds every recipe of a stage."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelConfig
from ..elastic.budget import BudgetSampler, warmup_steps_from_epochs
from ..elastic.tiers import capacity_tier
from .capacity_mixed import CapacityMixed, MicroPlan, Recipe, SharedRefinement, slot_rng

__all__ = ["BudgetDropout", "NestedFFN", "PosthocRecovery", "bd_warmup_steps", "make_recipe", "resolve_recipe_name"]

#: the random streams of ``NestedFFN``'s and ``PosthocRecovery``'s draws (capacity mixing and refinement use 1, 2)
_NESTED_STREAM, _POSTHOC_STREAM = 3, 4


class BudgetDropout(Recipe):
    """ES-SSM budget dropout (Sec. 4.2, Eq. 5, Algorithm 2): every micro-batch of a step trains at the budget K_train
    of ``elastic.budget.BudgetSampler`` (full during the warm-up ``bd_warmup_steps`` and on the anchors
    ``step % n_full == 0``, else Eq. 5's draw) with the plain task loss ``L_task(F_theta(u; K_train), y)``."""

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


class NestedFFN(Recipe):
    """MatFormer's nested-FFN recipe as the ESSH paper trains its baseline (N.1, Table 9): every slot draws one
    granularity uniformly and trains at that FFN width (``n_ff = align floor(d_ff xi / align)``, Table 39) with
    plain CE: no distillation, no gradient scaling, no reordering."""

    name = "nested_ffn"

    def __init__(self, model_cfg: Any, cfg: Any) -> None:
        grains = getattr(model_cfg, "granularities", None)
        if grains is None:
            raise ValueError(f"TrainConfig.recipe='nested_ffn' trains a MatFormer (model.arch matformer); the model "
                             f"config is {type(model_cfg).__name__}")
        self.model_cfg, self.seed = model_cfg, cfg.seed
        self.granularities = tuple(float(x) for x in grains)
        self.tiers = [capacity_tier(model_cfg, x) for x in self.granularities]

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "granularities": list(self.granularities), "seed": self.seed}

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        draws = slot_rng(self.seed, step, _NESTED_STREAM).integers(0, len(self.granularities), size=n_global)
        return [MicroPlan(label=self.granularities[i]) if self.tiers[i].n_ff == self.model_cfg.d_ff
                else MicroPlan(tier=self.tiers[i], label=self.granularities[i]) for i in map(int, draws)]


class PosthocRecovery(Recipe):
    """E.7 recovery: one uniformly drawn mask per slot; CE + forward KL from the frozen parent (coef 1)."""

    name = "posthoc"

    def __init__(self, model: nn.Module, cfg: Any) -> None:
        if model.__dict__.get("frozen_teacher") is None:
            raise ValueError("TrainConfig.recipe='posthoc' recovers a dense-trained parent under its frozen copy: "
                             "run `elastic-ssm recover PARENT --protocol posthoc` or elastic_ssm.train.recover."
                             "elastify, not `train` from scratch")
        self.masks = tuple(float(x) for x in cfg.mixing.capacities)
        self.tiers = [None if x == 1.0 else capacity_tier(model.config, x) for x in self.masks]
        self.seed = cfg.seed

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        teacher = model.__dict__["frozen_teacher"]
        teacher.to(next(model.parameters()).device).eval().requires_grad_(False)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "masks": list(self.masks), "seed": self.seed}

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        draws = slot_rng(self.seed, step, _POSTHOC_STREAM).integers(0, len(self.masks), size=n_global)
        return [MicroPlan(tier=self.tiers[int(i)], label=self.masks[int(i)], distill=("kl", 1.0)) for i in draws]


#: recipes defined for one architecture only (``ModelConfig.elastic_recipes`` says which a config takes)
_NEEDS = {"capacity_mixed": "the ESSH recipe (Algorithm 1)", "budget_dropout": "the ES-SSM recipe (Sec. 4.2)"}


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


def make_recipe(name: str, model: nn.Module, cfg: Any, data: Any = None, accum: int | None = None) -> Recipe:
    """The recipe object of stage ``name`` ('capacity_mixed', 'budget_dropout', 'nested_ffn', 'dense', 'refine',
    'posthoc'); ``accum``: micro-batches per rank and step (for an epoch-based budget-dropout warm-up)."""
    mcfg = getattr(model, "config", None)
    if name == "refine" and "refine" not in getattr(mcfg, "elastic_recipes", ()):
        raise ValueError("shared refinement (TrainConfig.refine.steps > 0) is defined for ESSH only")
    if name == "budget_dropout":
        return BudgetDropout(BudgetSampler(mcfg.budgets, mcfg.n_channels, n_full=cfg.budget_dropout.n_full,
                                           warmup_steps=bd_warmup_steps(cfg, data, accum), seed=cfg.seed))
    builders = {"capacity_mixed": lambda: CapacityMixed(mcfg, cfg), "refine": lambda: SharedRefinement(mcfg, cfg),
                "dense": Recipe, "posthoc": lambda: PosthocRecovery(model, cfg),
                "nested_ffn": lambda: NestedFFN(mcfg, cfg)}
    if name not in builders:
        raise ValueError(f"unknown recipe {name!r}")
    return builders[name]()
