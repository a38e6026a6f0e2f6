"""Recipes: the per-step micro-batch plan (``MicroPlan``); ESSH capacity-mixed pretraining (``CapacityMixed``:
Algorithm 1, D.4, D.5) and shared refinement (``SharedRefinement``: D.8, ``per_step`` or ``cycle``); their
objectives: ``losses.py``. The plan of the global slots, seeded with ``(seed, step)``, and the ``n_F`` draw:
docs/training.md, "One optimizer step", item 2.

FFN importance ordering (ESSH Appendix D.3; Algorithm 1 lines 22-26). Every ``order_every`` steps while
``0 < step < order_until x steps``, for every SwiGLU layer l:

    I_{l,h} = AllReduceMean( abar_{l,h}^2 * ||W_down[:, h]||^2 )      (line 24; ``SwiGLU.importance``)
    pi_l    = argsort_desc(I_l)                                         (line 25, stable)
    PermuteFFN(Theta_l, Omega_l, abar_l^2; pi_l)                        (line 26)

PermuteFFN reorders ``w_in.weight`` [2F, D] row pairs, ``w_out.weight`` [D, F] columns, ``act_sq`` [F] and the AdamW
moments of those weights (under FSDP2: gathered, permuted, cut back to this rank's shard); the function is unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import TierLike, TrainConfig
from ..elastic.tiers import capacity_tier, resolve_tier
from ..layers.ffn import unit_index, unit_norms_sq
from .dist import DistContext, _is_dtensor, all_reduce, full_tensor, shard_like

__all__ = ["MicroPlan", "Recipe", "CapacityMixed", "SharedRefinement", "slot_rng", "enable_tracking",
           "importance_scores", "permute_optimizer_state", "order_ffn_units"]

_CAPACITY_STREAM, _REFINE_STREAM = 1, 2


def slot_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """The generator of one step's draws: a pure function of ``(seed, step, stream)``."""
    return np.random.default_rng([int(seed), int(step), int(stream)])


@dataclass(frozen=True)
class MicroPlan:
    """What one micro-batch computes (the arguments of ``LossModule.forward``) and its log label."""

    tier: TierLike = None
    label: float | int = 1.0
    ffn_grad_scale: float | None = None
    distill: tuple[str, float] | None = None
    full_ce: bool = False


class Recipe:
    """Base recipe: every micro-batch at full capacity with plain CE (the ``dense`` recipe)."""

    name = "dense"
    #: the policy of ``optim.param_groups`` this recipe's stage uses
    policy = "pretrain"

    def setup(self, model: nn.Module) -> None:
        """Prepare the model before the first step: no FFN activation statistics (capacity mixing tracks them)."""
        enable_tracking(model, False)

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        """The plans of the global slots ``g = 0 .. n_global - 1`` (rank k runs ``g = r x world + k``)."""
        return [MicroPlan() for _ in range(n_global)]

    def after_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   ctx: DistContext) -> dict[str, Any]:
        """Hook after the optimizer update of 0-based ``step``; returns events to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The sampler settings (plans are pure functions of them and the step; saved in checkpoints)."""
        return {"name": self.name}


def reserved_slots(full_share: float, n_global: int, u: float = 1.0) -> int:
    """Micro-batch slots reserved for full capacity (D.4): ``floor(f x M)`` plus one more when the uniform
    draw ``u`` in [0, 1) falls below the remainder ``f x M - floor(f x M)``, so ``E[n_F] = f x M`` exactly."""
    x = full_share * n_global
    base = math.floor(x + 1e-9)             # 0.75 x 4 is 3, not 2.9999...
    frac = x - base if x - base > 1e-9 else 0.0
    return min(n_global, base + (1 if u < frac else 0))


class CapacityMixed(Recipe):
    """ESSH capacity-mixed pretraining (Algorithm 1) with FFN importance ordering (D.3)."""

    name = "capacity_mixed"

    def __init__(self, model_cfg: Any, cfg: TrainConfig) -> None:
        self.model_cfg, self.seed, self.total_steps = model_cfg, cfg.seed, cfg.steps
        self.mix, self.order = cfg.mixing, cfg.ordering
        self.capacities = tuple(float(x) for x in self.mix.capacities)
        self.tiers = [capacity_tier(model_cfg, x) for x in self.capacities]

    def setup(self, model: nn.Module) -> None:
        enable_tracking(model, self.order.every > 0, self.order.stat_decay)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "capacities": list(self.capacities), "full_share": self.mix.full_share,
                "n_warm_tokens": self.mix.n_warm_tokens, "seed": self.seed, "order_every": self.order.every,
                "order_until": self.order.until, "total_steps": self.total_steps}

    def capacities_of(self, step: int, tokens_seen: int, n_global: int) -> list[float]:
        """Capacity fraction of every global slot of ``step`` (Alg. 1 lines 4-7): a pure function of
        ``(seed, step, tokens_seen, n_global)``, the same on every rank."""
        if tokens_seen < self.mix.n_warm_tokens:
            return [1.0] * n_global
        rng = slot_rng(self.seed, step, _CAPACITY_STREAM)
        draws = rng.integers(0, len(self.capacities), size=n_global)
        whole = float(self.mix.full_share * n_global).is_integer()   # no remainder: no extra draw
        n_reserved = reserved_slots(self.mix.full_share, n_global, 1.0 if whole else float(rng.random()))
        return [1.0 if g < n_reserved else self.capacities[int(draws[g])] for g in range(n_global)]

    def plan_for(self, xi: float) -> MicroPlan:
        if xi == 1.0:
            return MicroPlan(label=1.0)
        tier, full = self.tiers[self.capacities.index(xi)], resolve_tier(self.model_cfg, None)
        if (tier.K, tier.n_ff) == (full.K, full.n_ff):     # a capacity that rounds to the full model
            return MicroPlan(label=xi)
        return MicroPlan(tier=tier, label=xi, ffn_grad_scale=self.mix.alpha_ff, distill=("kl", self.mix.kl_coef))

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        return [self.plan_for(x) for x in self.capacities_of(step, tokens_seen, n_global)]

    def after_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   ctx: DistContext) -> dict[str, Any]:
        every = self.order.every       # Algorithm 1 line 22 for the 0-based step that has just been applied
        if not (every > 0 and step > 0 and step % every == 0 and step < self.order.until * self.total_steps):
            return {}
        order_ffn_units(model, optimizer, ctx)
        return {"ffn_ordered": True}


class SharedRefinement(Recipe):
    """ESSH shared refinement (D.8): full CE + reduced CE + TV distillation, fresh AdamW (refine groups)."""

    name = "refine"
    policy = "refine"

    def __init__(self, model_cfg: Any, cfg: TrainConfig) -> None:
        r = cfg.refine
        self.capacities = tuple(float(x) for x in r.capacities)
        self.tiers = [capacity_tier(model_cfg, x) for x in self.capacities]
        self.tv_coef, self.alpha_ff, self.seed, self.mode = r.tv_coef, r.alpha_ff, cfg.seed, r.capacity_mode

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "capacities": list(self.capacities), "mode": self.mode, "seed": self.seed}

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        rng = slot_rng(self.seed, step, _REFINE_STREAM)
        if self.mode == "per_step":
            idx = [int(rng.integers(0, len(self.tiers)))] * n_global
        else:
            order = rng.permutation(len(self.tiers))
            idx = [int(order[g % len(order)]) for g in range(n_global)]
        return [MicroPlan(tier=self.tiers[i], label=self.capacities[i], ffn_grad_scale=self.alpha_ff,
                          distill=("tv", self.tv_coef), full_ce=True) for i in idx]


def enable_tracking(model: nn.Module, on: bool, stat_decay: float = 0.99) -> None:
    """Switch the running squared-activation statistics of every FFN layer on or off."""
    for ffn in model.ffn_layers() if hasattr(model, "ffn_layers") else []:
        ffn.track_activations = on
        ffn.stat_decay = stat_decay
        if on:
            ffn.start_stats()   # before a compiled forward updates them in place


def importance_scores(model: nn.Module, ctx: DistContext | None = None) -> list[torch.Tensor]:
    """Per-layer importance [F] averaged across ranks (line 24). Raises if statistics are missing."""
    scores = [_importance(ffn) for ffn in model.ffn_layers()]
    for s in scores if ctx is not None and ctx.distributed else ():
        all_reduce(s, ctx).div_(ctx.world_size)
    return scores


def _importance(ffn: nn.Module) -> torch.Tensor:
    """``ffn.importance()`` [F] (float32); with a sharded down weight the same formula on its full value."""
    if not _is_dtensor(ffn.w_out.weight) or ffn.act_sq is None:
        return ffn.importance()  # without statistics: the layer's error
    return ffn.act_sq * unit_norms_sq(full_tensor(ffn.w_out.weight))


def _permuted(t: torch.Tensor, perm: torch.Tensor, dim: int = 0, per_unit: int = 1) -> torch.Tensor:
    """``t`` with the units along ``dim`` (``per_unit`` entries each) reordered by ``perm``, laid out like
    ``t`` (a shard of the permuted whole for a ``DTensor``)."""
    full = full_tensor(t)
    return shard_like(full.index_select(dim, unit_index(perm.to(full.device), per_unit)).contiguous(), t)


@torch.no_grad()
def _permute_units(ffn: nn.Module, perm: torch.Tensor) -> None:
    """``ffn.permute_units(perm)``; for sharded weights each rank writes its shard of the permuted rows."""
    if not _is_dtensor(ffn.w_out.weight):
        ffn.permute_units(perm)
        return
    for p, dim, per in ffn.unit_tensors():
        p.to_local().copy_(_permuted(p, perm, dim, per).to_local())
    if ffn.act_sq is not None:
        ffn.act_sq = ffn.act_sq[perm.to(ffn.act_sq.device)]


@torch.no_grad()
def permute_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                            perm: torch.Tensor, dim: int = 0, per_unit: int = 1) -> None:
    """Reorder the units along ``dim`` (``per_unit`` entries each) of every state tensor of ``param`` that has
    the parameter's shape (AdamW's two moments after its first step; nothing before)."""
    state = optimizer.state.get(param) or {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
            state[key] = _permuted(value, perm, dim, per_unit)


@torch.no_grad()
def order_ffn_units(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    ctx: DistContext | None = None) -> list[torch.Tensor]:
    """PermuteFFN on every FFN layer of ``model``; returns the permutations. Without statistics on some rank yet,
    every layer stays in place (identity permutations)."""
    layers = model.ffn_layers()
    perms: list[torch.Tensor] = []
    missing = torch.tensor([float(any(f.act_sq is None for f in layers))], device=layers[0].w_out.weight.device)
    if ctx is not None:
        all_reduce(missing, ctx)  # every rank takes the same branch (the importances are a collective)
    if missing.item() > 0:
        return [torch.arange(f.d_ff, device=f.w_out.weight.device) for f in layers]
    for ffn, score in zip(layers, importance_scores(model, ctx)):
        perm = torch.argsort(score.to(ffn.w_out.weight.device), descending=True, stable=True)
        if optimizer is not None:
            for p, dim, per in ffn.unit_tensors():
                permute_optimizer_state(optimizer, p, perm, dim, per)
        _permute_units(ffn, perm)
        perms.append(perm)
    return perms
