"""FFN importance ordering (ESSH Appendix D.3; Algorithm 1 lines 22-26). Every ``order_every`` steps while
``0 < step < order_until x steps``, for every SwiGLU layer l:

    I_{l,h} = AllReduceMean( abar_{l,h}^2 * ||W_down[:, h]||^2 )      (line 24; ``SwiGLU.importance``)
    pi_l    = argsort_desc(I_l)                                         (line 25, stable)
    PermuteFFN(Theta_l, Omega_l, abar_l^2; pi_l)                        (line 26)

PermuteFFN reorders ``w_in.weight`` [2F, D] row pairs, ``w_out.weight`` [D, F] columns, ``act_sq`` [F] and the AdamW
moments of those weights (under FSDP2: gathered, permuted, cut back to this rank's shard); the function is unchanged."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.ffn import unit_index, unit_norms_sq
from .dist import DistContext, _is_dtensor, all_reduce, full_tensor, shard_like

__all__ = ["enable_tracking", "importance_scores", "permute_optimizer_state", "order_ffn_units"]


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
