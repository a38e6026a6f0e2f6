"""Fused single-token step of one ESSH spectral layer (ESSH Appendix O.3, Algorithm 4 lines 6-14), for every
retained channel k and row b, from the raw output ``h`` of the concatenated input projection::

    v      = (1 - beta_k) v0 + beta_k v0 / sqrt(|v0|^2 / P + eps)                   (Eq. 23)
    eta^w  = 2 sigmoid(s^w + b^w),   eta^r = 2 sigmoid(s^r + b^r)                   (C.2)
    decay  = rho exp(-softplus(s^D + b^D)) = rho sigmoid(-(s^D + b^D))             (O.3 identity)
    H_i    <- decay R(theta_i) H_i + eta^w_i e1 v^T                                 (Eq. 5, state [2, P])
    z      = sum_i eta^r_i H_i^T kappa_i - (sum_i a_i eta^r_i eta^w_i kc_i) v       (Eq. 24)
    out    = K^{-1/2} z                                                             (Sec. 4.1 readout scale)

``backend="triton"``: one program per (b, k), the M modes in registers; ``"torch"``: the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dispatch import pow2, resolve_decode_backend
from ..gemv import launch_options
from .inputs import ModalTables

__all__ = ["ModalConstants", "spectral_decode_step", "spectral_step_torch"]

# rows of ModalConstants.table [K, 9, M]
_BW, _BR, _BC, _RHO, _COS, _SIN, _KC, _KS, _AKC = range(9)


@dataclass
class ModalConstants:
    """Fixed per-layer constants of one tier: ``table [K, 9, M]`` (rows: write/read/clock biases, rho,
    cos theta, sin theta, kc, ks, a*kc) and ``beta [K]``, both in the state dtype."""

    table: torch.Tensor
    beta: torch.Tensor
    K: int
    M: int
    P: int
    eps: float

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.K)

    @classmethod
    @torch.no_grad()
    def pack(cls, bias: torch.Tensor, modal: ModalTables, beta: torch.Tensor, P: int, eps: float,
             dtype: torch.dtype) -> ModalConstants:
        """Pack a layer's modal tables into the kernel's layout: bias [K, 3, M], ``modal`` (rho, theta, kc, ks,
        a: [K, M]), beta [K] (computed by the layer, ideally in float64) -> ``table [K, 9, M]`` in ``dtype``."""
        rho, theta, kc, ks, a = modal
        rows = [bias[:, 0], bias[:, 1], bias[:, 2], rho, torch.cos(theta), torch.sin(theta), kc, ks, a * kc]
        table = torch.stack(rows, dim=1).to(dtype).contiguous()          # [K, 9, M]
        K, M = rho.shape
        return cls(table, beta.to(dtype).contiguous(), K, M, P, float(eps))


# ---- PyTorch reference of the fused step -----------------------------------------------------------
def spectral_step_torch(h: torch.Tensor, state: torch.Tensor, c: ModalConstants,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """h [B, K(P+3M)] raw projection, state [B, K, M, 2, P] updated in place -> out [B, K P] (scaled)."""
    B = h.shape[0]
    K, M, P = c.K, c.M, c.P
    t = c.table.to(state.dtype)
    hh = h.reshape(B, K, P + 3 * M).to(state.dtype)
    v0, pre = hh[..., :P], hh[..., P:].reshape(B, K, 3, M)               # [B,K,P], [B,K,3,M]
    beta = c.beta.to(state.dtype)[:, None]
    rms = torch.rsqrt(v0.pow(2).mean(-1, keepdim=True) + c.eps)
    v = (1 - beta) * v0 + beta * (v0 * rms)                               # Eq. 23
    w = 2 * torch.sigmoid(pre[:, :, 0] + t[:, _BW])                       # [B,K,M]
    r = 2 * torch.sigmoid(pre[:, :, 1] + t[:, _BR])
    decay = (t[:, _RHO] * torch.sigmoid(-(pre[:, :, 2] + t[:, _BC])))[..., None]
    cos, sin = t[:, _COS, :, None], t[:, _SIN, :, None]                   # [K,M,1]
    h0, h1 = state[..., 0, :], state[..., 1, :]                           # [B,K,M,P]
    n0 = decay * (cos * h0 - sin * h1) + w[..., None] * v[:, :, None, :]
    n1 = decay * (sin * h0 + cos * h1)
    state.copy_(torch.stack((n0, n1), dim=-2))
    z = ((r * t[:, _KC])[..., None] * n0 - (r * t[:, _KS])[..., None] * n1).sum(-2)
    z = z - (r * w * t[:, _AKC]).sum(-1, keepdim=True) * v                # zero-lag correction (Eq. 24)
    return (z * c.scale).to(out_dtype or h.dtype).reshape(B, K * P)


def _spectral_step_triton(h, state, c: ModalConstants, out_dtype, pdl: bool = False):
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the Triton decode step needs a contiguous float32 state [B, K, M, 2, P]")
    B = h.shape[0]
    h = h if h.stride(-1) == 1 else h.contiguous()
    out = torch.empty(B, c.K * c.P, dtype=out_dtype or h.dtype, device=h.device)
    from ..gemv.triton_kernels import spectral_step_kernel  # imports triton: on this path only

    spectral_step_kernel[(B * c.K,)](h, state, out, c.table, c.beta, c.K, c.P, c.M, h.stride(0), out.stride(0),
                                     c.eps, c.scale, BLOCK_P=pow2(c.P, 16), BLOCK_M=pow2(c.M, 2), PDL=pdl,
                                     num_warps=2 if c.P <= 32 else 4, **launch_options(pdl))
    return out


def spectral_decode_step(h: torch.Tensor, state: torch.Tensor, consts: ModalConstants,
                         out_dtype: torch.dtype | None = None, backend: str = "auto",
                         pdl: bool = False) -> torch.Tensor:
    """One recurrent step of a whole spectral layer: h [B, K (P + 3M)] raw ``in_proj`` output, state [B, K, M, 2,
    P] updated in place -> ``K^{-1/2} z`` [B, K P] in ``out_dtype`` (default ``h.dtype``); ``pdl``: ``ops/gemv``."""
    K, M, P = consts.K, consts.M, consts.P
    if h.dim() != 2 or h.shape[1] != K * (P + 3 * M):
        raise ValueError(f"h must be [B, K(P+3M)] = [B, {K * (P + 3 * M)}], got {tuple(h.shape)}")
    want = (h.shape[0], K, M, 2, P)
    if tuple(state.shape) != want:
        raise ValueError(f"state must be [B, K, M, 2, P] = {want}, got {tuple(state.shape)}")
    if resolve_decode_backend(backend, h.device) == "triton" and state.dtype == torch.float32:
        return _spectral_step_triton(h, state, consts, out_dtype, pdl)
    return spectral_step_torch(h, state, consts, out_dtype)
