"""Decode plans: what each layer hands the fused decoder for one tier (ESSH Appendix O.3, Algorithm 4).

A plan holds prefix views of its layer's weights and its kernel's constants; ``fused(x, norm, eps, state, opts)``
(batch <= ``ops.gemv.MAX_FUSED_BATCH``: float32 stream x [B, D] updated in place) or ``batched(...)`` (cuBLAS;
returns the new x) runs its part of a step. The math of every plan is its layer's ``step``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.gemv import gemv_accumulate, norm_gemv, norm_swiglu_gemv, rms_norm, swiglu
from ..ops.spectral_scan.decode_triton import ModalConstants, spectral_decode_step
from ..ops.swa_decode import swa_decode_step

__all__ = ["DecodeOptions", "SpectralPlan", "AttentionPlan", "FFNPlan", "in_by_out_copy"]


@dataclass(frozen=True)
class DecodeOptions:
    """Kernel choices of one decoder: ``backend`` 'triton' | 'torch', programmatic dependent launch,
    the torch window step's ``attention`` ('sdpa' | 'math'), the window ring's attended ``span`` (its first
    slots only, ``ops.swa_decode``; None: the whole ring), and for rows at different tiers the per-row
    ``channel_scale [B, K P]`` and ``unit_mask [B, n_ff]`` (docs/performance.md; None: every row at the plan's tier)."""

    backend: str
    pdl: bool
    attention: str
    span: int | None = None
    channel_scale: torch.Tensor | None = None
    unit_mask: torch.Tensor | None = None


def _per_row(a: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """``a * factor`` (rows' own tiers), in place, computed in the wider dtype and rounded once (one kernel, no cast
    of ``factor`` per step); ``a`` itself when every row is at the plan's."""
    return a if factor is None else a.mul_(factor[:a.shape[0]])


def residual_mm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x + a @ w with the add in the GEMM epilogue when dtypes agree. x [B,D], a [B,N], w [N,D]."""
    return torch.addmm(x, a, w) if x.dtype == w.dtype and a.dtype == w.dtype else x + (a.to(w.dtype) @ w).to(x.dtype)


def in_by_out_copy(w_rows: torch.Tensor, copy: bool) -> torch.Tensor | None:
    """The in-by-out contiguous copy [N, D] of an out-by-in weight view [D, N] for the split kernel, if asked."""
    return w_rows.t().contiguous() if copy else None


@dataclass
class _Plan:
    """What every plan holds: the input product's weight ``w_in`` and the output product's ``w_out_rows`` [D, N]
    (out x in, a prefix view of the module's weight); a subclass may keep its in-by-out copy ``w_out_split``."""

    w_in: torch.Tensor
    w_out_rows: torch.Tensor
    w_out_split = None      # a field of the plans that keep the copy (split kernel)

    @property
    def w_out(self) -> torch.Tensor:
        """The output product's weight in x out [N, D] (the copy, else a transposed view)."""
        return self.w_out_split if self.w_out_split is not None else self.w_out_rows.t()

    def add_out(self, a: torch.Tensor, x: torch.Tensor, o: DecodeOptions) -> None:
        """x += a @ w_out: split over the rows of ``w_out_split`` when the plan keeps it, else one output per
        program from ``w_out_rows``."""
        if self.w_out_split is not None:
            gemv_accumulate(a, self.w_out_split, x, backend=o.backend, pdl=o.pdl)
        else:
            norm_gemv(a, self.w_out_rows, out=x, residual=True, backend=o.backend, pdl=o.pdl)


@dataclass
class SpectralPlan(_Plan):
    """Spectral mixer at one tier: in_proj prefix [K(P+3M), D], out_proj prefix ``w_out_rows`` [D, K P]
    (a column prefix), modal constants, and optionally an in-by-out copy ``w_out_split`` [K P, D]."""

    consts: ModalConstants
    w_out_split: torch.Tensor | None = None

    def fused(self, x, norm, eps, state, o: DecodeOptions) -> None:
        h = norm_gemv(x, self.w_in, norm, eps, backend=o.backend, pdl=o.pdl)          # [B, K(P+3M)]
        z = spectral_decode_step(h, state, self.consts, x.dtype, o.backend, pdl=o.pdl)  # [B, K P] scaled
        self.add_out(_per_row(z, o.channel_scale), x, o)

    def batched(self, x, norm, eps, state, o: DecodeOptions) -> torch.Tensor:
        h = F.linear(rms_norm(x, norm, eps, o.backend), self.w_in)
        wt, s = self.w_out.dtype, o.channel_scale
        z = spectral_decode_step(h, state, self.consts, wt if s is None else torch.promote_types(wt, torch.float32),
                                 o.backend)                                               # [B, K P] scaled
        if s is not None:   # rows at their own tiers: z sqrt(K / K_T) in float32, rounded once into the product's dtype
            z = torch.mul(z, s[:z.shape[0]], out=torch.empty_like(z, dtype=wt))
        return residual_mm(x, z, self.w_out)                          # one addmm: every operand in the weights' dtype


@dataclass
class AttentionPlan(_Plan):
    """Sliding-window attention: qkv [3D, D], out [D, D] (out x in; ``w_out`` is its in x out view) and
    the RoPE frequency table (float64 [hd / 2])."""

    inv_freq: torch.Tensor

    def _attend(self, qkv, ring, out_dtype, o: DecodeOptions) -> torch.Tensor:
        return swa_decode_step(qkv, ring.keys, ring.values, ring.slot_pos, ring.positions, self.inv_freq,
                               o.backend, o.attention, out_dtype, pdl=o.pdl, span=o.span)

    def fused(self, x, norm, eps, ring, o: DecodeOptions) -> None:
        att = self._attend(norm_gemv(x, self.w_in, norm, eps, backend=o.backend, pdl=o.pdl), ring, x.dtype, o)
        self.add_out(att, x, o)

    def batched(self, x, norm, eps, ring, o: DecodeOptions) -> torch.Tensor:
        qkv = F.linear(rms_norm(x, norm, eps, o.backend), self.w_in)
        return residual_mm(x, self._attend(qkv, ring, x.dtype, o), self.w_out)


@dataclass
class FFNPlan(_Plan):
    """SwiGLU at one tier: w_in prefix [2 n_ff, D] (rows gate_h, up_h), w_out prefix ``w_out_rows``
    [D, n_ff] (a column prefix), optionally an in-by-out copy ``w_out_split`` [n_ff, D]."""

    w_out_split: torch.Tensor | None = None

    def fused(self, x, norm, eps, state, o: DecodeOptions) -> None:
        a = norm_swiglu_gemv(x, self.w_in, norm, eps, backend=o.backend, pdl=o.pdl)
        self.add_out(_per_row(a, o.unit_mask), x, o)

    def batched(self, x, norm, eps, state, o: DecodeOptions) -> torch.Tensor:
        a = swiglu(F.linear(rms_norm(x, norm, eps, o.backend), self.w_in), o.backend)
        return residual_mm(x, _per_row(a, o.unit_mask), self.w_out)
