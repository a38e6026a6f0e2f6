"""Elastic SwiGLU feed-forward layer (Shazeer, 2020) with prefix width and FFN gradient scaling.

Storage is unit-major so a tier keeps a dim-0 prefix (ESSH D.2): ``w_in`` [F, 2, D] holds the gate
and up rows of unit h at ``w_in[h, 0]`` and ``w_in[h, 1]``; ``w_out`` [F, D] holds the down-projection
column of unit h as a row. ``forward(x, n_ff, grad_scale)`` evaluates only the first ``n_ff`` units
and, for reduced-capacity micro-batches, applies W_hat = a W + (1 - a) sg(W) to the retained weights
(ESSH D.4: forward unchanged, parameter gradients scaled by a = alpha_ff).

For the importance ordering (ESSH D.3) the layer can keep a running mean of squared unit activations
``act_sq`` [F] on full-width calls when ``track_activations`` is set (training state, not a parameter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..elastic.slicing import prefix
from .decode_plan import FFNPlan


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
    """W_hat = alpha W + (1 - alpha) sg(W) (ESSH D.4): bit-exact identity forward, gradient scaled by alpha.

    Implemented as a custom autograd function, so the forward reads W itself (no weight-sized temporaries)
    for every alpha, and the parameter gradient from this branch is exactly alpha times the unscaled one.
    """
    return _ScaleGrad.apply(w, alpha)


class SwiGLU(nn.Module):
    """y = W_down (silu(W_gate x) * (W_up x)) with elastic width."""

    def __init__(self, d_model: int, d_ff: int, init_std: float = 0.02, out_std: float | None = None) -> None:
        super().__init__()
        self.d_model, self.d_ff = d_model, d_ff
        self.init_std, self.out_std = init_std, out_std if out_std is not None else init_std
        self.w_in = nn.Parameter(torch.empty(d_ff, 2, d_model))   # [F, 2, D]
        self.w_out = nn.Parameter(torch.empty(d_ff, d_model))     # [F, D]
        self.track_activations = False
        self.stat_decay = 0.99
        self.act_sq: torch.Tensor | None = None                   # [F] running mean of a_h^2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.w_in.device.type == "meta":
            return
        nn.init.normal_(self.w_in, std=self.init_std)
        nn.init.normal_(self.w_out, std=self.out_std)

    def forward(self, x: torch.Tensor, n_ff: int | None = None, grad_scale: float | None = None) -> torch.Tensor:
        n = self.d_ff if n_ff is None else n_ff
        w_in = prefix(self.w_in, n).reshape(2 * n, self.d_model)   # [2F', D], rows (gate_h, up_h)
        w_out = prefix(self.w_out, n)                               # [F', D]
        if grad_scale is not None and grad_scale != 1.0:
            w_in, w_out = scale_grad(w_in, grad_scale), scale_grad(w_out, grad_scale)
        gate, up = F.linear(x, w_in).unflatten(-1, (n, 2)).unbind(-1)   # [..., F'] each (strided views)
        act = F.silu(gate) * up                                     # [..., F']; backward stacks dh in one pass
        if self.track_activations and self.training and n == self.d_ff:
            self._update_stats(act)
        return act @ w_out.to(act.dtype)                            # [..., D]

    @torch.no_grad()
    def decode_plan(self, tier=None, row_copies: bool = False) -> FFNPlan:
        """The fused step's weights at ``tier`` (its ``n_ff``, an int, or None = all units;
        ``layers/decode_plan.py``): prefix views ``w_in`` [2 n_ff, D] and ``w_out`` [n_ff, D], and with
        ``row_copies`` an out-by-in copy of ``w_out``."""
        n = self.d_ff if tier is None else int(getattr(tier, "n_ff", tier))
        w_out = prefix(self.w_out, n)
        return FFNPlan(prefix(self.w_in, n).reshape(2 * n, self.d_model), w_out,
                       w_out.t().contiguous() if row_copies else None)

    @torch.no_grad()
    def _update_stats(self, act: torch.Tensor) -> None:
        m = act.detach().float().pow(2).reshape(-1, act.shape[-1]).mean(0)
        if self.act_sq is None or self.act_sq.shape != m.shape:
            self.act_sq = m
        else:
            self.act_sq.mul_(self.stat_decay).add_(m, alpha=1 - self.stat_decay)

    def importance(self) -> torch.Tensor:
        """I_h = abar_h^2 * ||W_down[:, h]||^2 (ESSH D.3 / Algorithm 1 line 24); [F]."""
        if self.act_sq is None:
            raise RuntimeError("no activation statistics yet: enable track_activations and run full-width steps")
        return self.act_sq * self.w_out.detach().float().pow(2).sum(-1)

    @torch.no_grad()
    def permute_units(self, perm: torch.Tensor) -> None:
        """Reorder units by ``perm`` (new unit i = old unit perm[i]); the full-width function is unchanged."""
        self.w_in.copy_(self.w_in[perm])
        self.w_out.copy_(self.w_out[perm])
        if self.act_sq is not None:
            self.act_sq = self.act_sq[perm.to(self.act_sq.device)]
