"""Elastic SwiGLU feed-forward layer (Shazeer, 2020): a tier keeps a unit prefix (ESSH D.2) of ``w_in.weight``
[2F, D] (rows gate_h, up_h) and ``w_out.weight`` [D, F] (column h = unit h); FFN gradient scaling (D.4) and
the running activation statistics ``act_sq`` [F] of the FFN ordering (D.3). Beside it RMSNorm (Zhang & Sennrich,
2019), the pre-norm of every block (before its mixer and this FFN) and the final norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..elastic.slicing import empty_linear, linear, linear_weight
from ..elastic.tiers import tier_width
from ..ops.gemv import rms_norm
from .decode_plan import FFNPlan, in_by_out_copy


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``alpha``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.alpha, None


def scale_grad(w: torch.Tensor, alpha: float) -> torch.Tensor:
    """W_hat = alpha W + (1 - alpha) sg(W) (ESSH D.4): bit-exact identity forward, gradient scaled by alpha."""
    return _ScaleGrad.apply(w, alpha)


class SwiGLU(nn.Module):
    """y = W_down (silu(W_gate x) * (W_up x)) with elastic width."""

    def __init__(self, d_model: int, d_ff: int, init_std: float = 0.02, out_std: float | None = None) -> None:
        super().__init__()
        self.d_model, self.d_ff = d_model, d_ff
        self.init_std, self.out_std = init_std, out_std if out_std is not None else init_std
        self.w_in = empty_linear(d_model, 2 * d_ff)     # weight [2F, D], rows (gate_h, up_h)
        self.w_out = empty_linear(d_ff, d_model)        # weight [D, F], column h = unit h
        self.grad_scale: float | None = None   # D.4's alpha_ff, set by train.losses.ffn_grad_scaled
        self.track_activations = False
        self.stat_decay = 0.99
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.w_in.weight.device.type == "meta":
            return
        with torch.no_grad():   # drawn in the unit-major order of the layout before nn.Linear (same model per seed)
            nn.init.normal_(self.w_in.weight, std=self.init_std)
            self.w_out.weight.copy_(self.w_out.weight.new_empty(self.d_ff, self.d_model).normal_(std=self.out_std).t())

    def forward(self, x: torch.Tensor, n_ff: int | None = None, unit_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., D] -> [..., D] through the first ``n_ff`` units (None: all). ``unit_mask`` [B, n_ff] (0/1, x
        [B, ..., D]): each row keeps its own tier's units (``elastic/slicing.py``)."""
        n = self.d_ff if n_ff is None else n_ff
        grad_scale = self.grad_scale
        scaled = grad_scale is not None and grad_scale != 1.0
        if scaled:   # W_hat of D.4 on the retained prefixes ([2F', D] rows, [D, F'] columns)
            h = F.linear(x, scale_grad(linear_weight(self.w_in, rows=2 * n), grad_scale))
        else:        # the modules themselves at full width (quantized or adapted modules compute)
            h = linear(self.w_in, x, rows=2 * n)
        gate, up = h.unflatten(-1, (n, 2)).unbind(-1)               # [..., F'] each (strided views)
        act = F.silu(gate) * up                                     # [..., F']; backward stacks dh in one pass
        if unit_mask is not None:
            act = act * unit_mask.view(act.shape[0], *([1] * (act.dim() - 2)), -1).to(act.dtype)
        if self.track_activations and self.training and n == self.d_ff:
            self._update_stats(act)
        if scaled:
            w_out = scale_grad(linear_weight(self.w_out, cols=n), grad_scale)
            return F.linear(act.to(w_out.dtype), w_out)
        return linear(self.w_out, act, cols=n)                      # [..., D]

    @torch.no_grad()
    def decode_plan(self, tier=None, split_copy: bool = False) -> FFNPlan:
        """The fused step's plan at ``tier`` (its ``n_ff``, an int, or None): prefix views of ``w_in.weight``
        [2 n_ff, D] and ``w_out.weight`` [D, n_ff], with ``split_copy`` an in-by-out copy [n_ff, D] of the latter."""
        n = tier_width(tier, self.d_ff, "n_ff")
        w_out = linear_weight(self.w_out, cols=n)
        return FFNPlan(linear_weight(self.w_in, rows=2 * n), w_out, in_by_out_copy(w_out, split_copy))

    def start_stats(self) -> None:
        """Allocate the statistics (outside a forward): non-persistent buffers ``stat_sq`` [F] (float32) and
        ``stat_seen`` (a 0-dim bool). Every update overwrites them in place, so under ``torch.compile`` with CUDA
        graphs they are never a graph output that the next replay overwrites."""
        if "stat_sq" not in self._buffers:
            dev = self.w_out.weight.device
            self.register_buffer("stat_sq", torch.zeros(self.d_ff, device=dev), persistent=False)
            self.register_buffer("stat_seen", torch.zeros((), dtype=torch.bool, device=dev), persistent=False)

    @property
    def act_sq(self) -> torch.Tensor | None:
        """[F] running mean of a_h^2 (D.3): the first tracked full-width step's mean, then an EMA of decay
        ``stat_decay``; None before that step. Setting it copies the value in (None: no statistics)."""
        return self.stat_sq if "stat_sq" in self._buffers and bool(self.stat_seen) else None

    @act_sq.setter
    def act_sq(self, value: torch.Tensor | None) -> None:
        self.start_stats()
        if value is not None:
            self.stat_sq.copy_(value)
        self.stat_seen.fill_(value is not None)

    @torch.no_grad()
    def _update_stats(self, act: torch.Tensor) -> None:
        m = act.detach().float().pow(2).reshape(-1, act.shape[-1]).mean(0)     # [F]
        self.start_stats()                                  # allocated already, unless tracking was switched on by hand
        ema = torch.add(self.stat_sq * self.stat_decay, m, alpha=1 - self.stat_decay)
        self.stat_sq.copy_(torch.where(self.stat_seen, ema, m))
        self.stat_seen.fill_(True)

    def importance(self) -> torch.Tensor:
        """I_h = abar_h^2 * ||W_down[:, h]||^2 (ESSH D.3 / Algorithm 1 line 24); [F]."""
        if self.act_sq is None:
            raise RuntimeError("no activation statistics yet: enable track_activations and run full-width steps")
        return self.act_sq * unit_norms_sq(self.w_out.weight.detach())

    def unit_tensors(self) -> list[tuple[nn.Parameter, int, int]]:
        """``(parameter, dim, entries per unit)`` of each unit-indexed weight: ``w_in.weight`` rows (gate_h,
        up_h: 2 per unit) and ``w_out.weight`` columns (1 per unit); what a unit permutation reorders."""
        return [(self.w_in.weight, 0, 2), (self.w_out.weight, 1, 1)]

    @torch.no_grad()
    def permute_units(self, perm: torch.Tensor) -> None:
        """Reorder units by ``perm`` (new unit i = old unit perm[i]); the full-width function is unchanged."""
        for p, dim, per in self.unit_tensors():
            p.copy_(p.index_select(dim, unit_index(perm.to(p.device), per)))
        if "stat_sq" in self._buffers:
            self.stat_sq.copy_(self.stat_sq[perm.to(self.stat_sq.device)])


def unit_norms_sq(w_out: torch.Tensor) -> torch.Tensor:
    """||W_down[:, h]||^2 of every unit h of a down weight [D, F] -> [F] (float32)."""
    return w_out.float().pow(2).sum(0)


def unit_index(perm: torch.Tensor, per_unit: int) -> torch.Tensor:
    """Entry indices of a unit permutation ``perm`` [F] along a dim holding ``per_unit`` entries per unit:
    [F * per_unit], unit perm[i]'s entries at i * per_unit + (0 .. per_unit - 1)."""
    return perm if per_unit == 1 else (perm[:, None] * per_unit + torch.arange(per_unit, device=perm.device)).flatten()


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim D; computed in float32 under autocast."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight, self.eps, backend="torch")
