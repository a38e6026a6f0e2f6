"""The recipes of one file each too small to stand alone, and recipe selection: ``BudgetDropout`` (ES-SSM),
``NestedFFN`` (MatFormer), ``PosthocRecovery`` (E.7's recovery under a frozen parent, ``recover.py``),
``resolve_recipe_name`` ('auto' is the model config's ``default_recipe()``; a recipe of another architecture is
refused) and ``make_recipe``, the one place that builds every recipe of a stage. ``BudgetSampler``: the training-budget
schedule of ES-SSM (Sec. 4.2, Eq. 5; Algorithm 2, whose text ends mid-way: DESIGN; docs/es_ssm.md, "Budget
dropout"); ``sample(step)`` is a pure function of ``(seed, step)``: a resumed run needs no sampler state.

The optimizer every recipe trains with: AdamW parameter groups (a recipe's ``policy``) and the learning-rate schedule
(ESSH Table 7, Appendices E.2 and D.8). Pretraining (E.2): no weight decay on ``rho_raw``, ``theta``, ``kc``, ``ks``,
embeddings, normalisation weights, biases (``gate_bias``, ``*.bias``) and the blend coefficients ``beta``; decay on the
zero-lag table ``a`` and every other tensor with >= 2 dims. Shared refinement (D.8): decay on every tensor with >= 2
dims, none on vectors. Schedule: linear warm-up to the peak, then cosine to ``min_frac x peak`` (Table 7: 1%, 10%; D.8:
5%, zero)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..elastic.tiers import capacity_tier
from .capacity_mixed import CapacityMixed, MicroPlan, Recipe, SharedRefinement, slot_rng

__all__ = ["BudgetSampler", "warmup_steps_from_epochs", "BudgetDropout", "NestedFFN", "PosthocRecovery",
           "bd_warmup_steps", "make_recipe", "resolve_recipe_name", "NO_DECAY_NAMES", "param_groups", "build_adamw",
           "WarmupCosine"]

#: the random streams of ``NestedFFN``'s and ``PosthocRecovery``'s draws (capacity mixing and refinement use 1, 2)
_NESTED_STREAM, _POSTHOC_STREAM = 3, 4


def warmup_steps_from_epochs(epochs: float, steps_per_epoch: int) -> int:
    """Warm-up length in steps of ``epochs`` epochs of ``steps_per_epoch`` steps each (rounded up)."""
    if epochs < 0 or steps_per_epoch < 1:
        raise ValueError(f"need epochs >= 0 and steps_per_epoch >= 1, got {epochs}, {steps_per_epoch}")
    return math.ceil(epochs * steps_per_epoch)


@dataclass(eq=False)
class BudgetSampler:
    """Log-uniform snapped budget sampler (Eq. 5) over the channel counts ``budgets`` (all <= ``full``, K-bar),
    at ``full`` for ``warmup_steps`` steps and on every later ``step % n_full == 0`` (paper: 8; 0: no anchors)."""

    budgets: Sequence[int]
    full: int
    warmup_steps: int = 0
    n_full: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        bs = sorted({int(b) for b in self.budgets})
        if not bs or bs[0] < 1:
            raise ValueError(f"budgets must be a non-empty set of channel counts >= 1, got {list(self.budgets)}")
        if int(self.full) < bs[-1]:
            raise ValueError(f"full budget {self.full} is smaller than the largest budget {bs[-1]}; pass K-bar")
        if self.warmup_steps < 0 or self.n_full < 0 or self.seed < 0:
            raise ValueError(f"warmup_steps, n_full and seed must be >= 0, got {self.warmup_steps}, {self.n_full}, "
                             f"{self.seed}")
        self.budgets, self.full = tuple(bs), int(self.full)
        self.warmup_steps, self.n_full, self.seed = int(self.warmup_steps), int(self.n_full), int(self.seed)
        self._arr = np.asarray(self.budgets, dtype=np.float64)

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> BudgetSampler:
        """A sampler over ``cfg.budgets`` with ``full = cfg.n_channels`` (an ``ESSSMConfig``)."""
        return cls(cfg.budgets, cfg.n_channels, **kw)

    @property
    def k_min(self) -> int:
        return self.budgets[0]

    def is_full_step(self, step: int) -> bool:
        """True for warm-up steps and post-warm-up anchors (``step % n_full == 0``)."""
        return step < self.warmup_steps or (self.n_full > 0 and step % self.n_full == 0)

    def snap(self, target: float) -> int:
        """Nearest budget to ``target`` (Eq. 5 argmin); a tie goes to the smaller budget."""
        return self.budgets[int(np.argmin(np.abs(self._arr - target)))]

    def sample(self, step: int) -> int:
        """K_train of global step ``step`` (>= 0): K-bar on full steps, else Eq. 5's ``target = K_min (K-bar /
        K_min)^xi`` with ``xi ~ U[0, 1)``, snapped to the nearest budget."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.is_full_step(step):
            return self.full
        xi = np.random.default_rng([self.seed, int(step)]).random()
        return self.snap(self.k_min * (self.full / self.k_min) ** xi)

    __call__ = sample

    def snap_probabilities(self) -> dict[int, float]:
        """Exact P(K_train = k) of an Eq. 5 draw (no warm-up, no anchor): budget b_i wins for targets between the
        midpoints around it, and P(target <= x) = log(x / K_min) / log(K-bar / K_min)."""
        if self.full == self.k_min:
            return {b: float(b == self.full) for b in self.budgets}
        span = math.log(self.full / self.k_min)
        cdf = lambda x: min(1.0, max(0.0, math.log(x / self.k_min) / span))
        edges = [self.k_min] + [(a + b) / 2 for a, b in zip(self.budgets, self.budgets[1:])] + [self.full]
        return {b: cdf(hi) - cdf(lo) for b, lo, hi in zip(self.budgets, edges, edges[1:])}

    def expected_distribution(self) -> dict[int, float]:
        """Long-run post-warm-up P(K_train = k): anchors (1 / n_full) mixed with the Eq. 5 draws."""
        a = 1.0 / self.n_full if self.n_full else 0.0
        out = {b: (1.0 - a) * p for b, p in self.snap_probabilities().items()}
        out[self.full] = out.get(self.full, 0.0) + a
        return out

    def distribution(self, n_steps: int, start: int = 0) -> dict[int, float]:
        """Empirical fraction of each budget over steps ``start .. start + n_steps - 1`` (for reports)."""
        if n_steps < 1:
            raise ValueError(f"n_steps must be >= 1, got {n_steps}")
        counts = Counter(self.sample(s) for s in range(start, start + n_steps))
        return {k: counts[k] / n_steps for k in sorted({*self.budgets, self.full})}

    def state_dict(self) -> dict[str, Any]:
        """The settings (the schedule itself is a pure function of them and the step)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"budgets": list(self.budgets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the settings of ``state_dict()``; unknown or missing keys raise ``KeyError``."""
        keys = [f.name for f in fields(self)]
        if set(state) != set(keys):
            raise KeyError(f"BudgetSampler state needs exactly the keys {sorted(keys)}, got {sorted(state)}")
        self.__dict__.update(vars(BudgetSampler(**state)))   # checked before anything changes


class BudgetDropout(Recipe):
    """ES-SSM budget dropout (Sec. 4.2, Eq. 5, Algorithm 2): every micro-batch of a step trains at the budget K_train
    of ``BudgetSampler`` (full during the warm-up ``bd_warmup_steps`` and on the anchors
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


#: Parameter leaf names excluded from weight decay during pretraining (E.2), besides embeddings,
#: normalisation parameters and biases, which are recognised by module type / name.
NO_DECAY_NAMES = frozenset({"rho_raw", "theta", "kc", "ks", "beta", "gate_bias"})


def _decays(module: nn.Module, leaf: str, p: torch.Tensor, policy: str) -> bool:
    """Whether parameter ``leaf`` of ``module`` is weight-decayed under ``policy``."""
    if policy == "refine":  # D.8, literally: every tensor with >= 2 dims (gate_bias [K, 3, M] included)
        return p.dim() >= 2
    if isinstance(module, (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "Norm" in type(module).__name__:
        return False
    return False if leaf in NO_DECAY_NAMES or leaf == "bias" or leaf.endswith("_bias") else p.dim() >= 2


def param_groups(model: nn.Module, weight_decay: float, policy: str = "pretrain") -> list[dict[str, Any]]:
    """The AdamW groups ``[{decay}, {no decay}]`` (each with its ``names``; empty ones dropped) of ``policy``
    ``"pretrain"`` (E.2) or ``"refine"`` (D.8); tied parameters once, frozen ones left out."""
    if policy not in ("pretrain", "refine"):
        raise ValueError(f"policy must be 'pretrain' or 'refine', got {policy!r}")
    seen: set[int] = set()
    groups: tuple[list, list] = ([], [])       # (name, parameter) pairs with decay, without
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups[not _decays(module, leaf, p, policy)].append((f"{mod_name}.{leaf}" if mod_name else leaf, p))
    return [{"params": [p for _, p in g], "names": [n for n, _ in g], "weight_decay": wd}
            for g, wd in zip(groups, (weight_decay, 0.0)) if g]


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, ...], weight_decay: float,
                eps: float = 1e-8, policy: str = "pretrain") -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (fp32 master weights: the model's own): fused when every parameter is on a GPU,
    else foreach (deterministic on CPU, as the bit-exact resume needs)."""
    groups = param_groups(model, weight_decay, policy)
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    kw: dict[str, Any] = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, **kw)


@dataclass(frozen=True)
class WarmupCosine:
    """lr(step) for 0-based steps: ``peak * (step + 1) / warmup`` while ``step < warmup``, then
    ``floor + (peak - floor) * (1 + cos(pi * s)) / 2`` with ``s = (step - warmup) / (total - warmup)`` and
    ``floor = min_frac * peak`` (the floor falls one step after the last: no step is wasted at lr 0)."""

    peak: float
    total: int
    warmup: int
    min_frac: float

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.warmup <= self.total or self.peak <= 0:
            raise ValueError(f"WarmupCosine needs total >= 1, 0 <= warmup <= total, peak > 0; got {self}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        floor = self.min_frac * self.peak
        s = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * s))

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "total": self.total, "warmup": self.warmup, "min_frac": self.min_frac}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume with a different schedule (the LR curve would silently change)."""
        if state != self.state_dict():
            raise ValueError(f"cannot resume: the checkpoint's LR schedule {state} differs from this run's "
                             f"{self.state_dict()}; use the same steps, lr, warmup_frac and min_lr_frac")
