"""The ESSH selective spectral scan (ESSH paper Sec. 4.1/4.3, Eq. 5 and 24, Appendix O): a stateless op.

``spectral_scan`` checks its inputs and dispatches to the chunked PyTorch scan (``"torch"``, Algorithm 2),
fla's GLA kernels (``"fla"``) or the spec (``"naive"``); inside the package the five modal tables travel as one
``ModalTables`` (``scan``). ``spectral_scan_step``: the single-token decode step (Algorithm 4, lines 10-14;
Appendix O.3) in plain torch; ``spectral_decode_step``: the fused single-token step of one ESSH spectral layer
(ESSH Appendix O.3, Algorithm 4 lines 6-14), for every retained channel k and row b, from the raw output ``h`` of the
concatenated input projection::

    v      = (1 - beta_k) v0 + beta_k v0 / sqrt(|v0|^2 / P + eps)                   (Eq. 23)
    eta^w  = 2 sigmoid(s^w + b^w),   eta^r = 2 sigmoid(s^r + b^r)                   (C.2)
    decay  = rho exp(-softplus(s^D + b^D)) = rho sigmoid(-(s^D + b^D))             (O.3 identity)
    H_i    <- decay R(theta_i) H_i + eta^w_i e1 v^T                                 (Eq. 5, state [2, P])
    z      = sum_i eta^r_i H_i^T kappa_i - (sum_i a_i eta^r_i eta^w_i kc_i) v       (Eq. 24)
    out    = K^{-1/2} z                                                             (Sec. 4.1 readout scale)

``backend="triton"``: one program per (b, k), the M modes in registers (``ops/gemv/triton_kernels.py``); ``"torch"``:
the reference. Math and edge values: README.md beside this file."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dispatch import pow2, resolve_backend, resolve_decode_backend
from ..gemv import launch_options
from .chunk_fla import fla_spectral_scan
from .chunk_torch import chunk_spectral_scan
from .inputs import ModalTables, host_sync_allowed, poison_out_of_range, validate_scan_inputs, validate_scan_values
from .naive import naive_spectral_scan

__all__ = ["ModalConstants", "ModalTables", "chunk_spectral_scan", "naive_spectral_scan", "scan", "spectral_scan",
           "spectral_scan_step", "validate_scan_inputs", "validate_scan_values", "spectral_decode_step",
           "spectral_step_torch"]

_HALF = (torch.bfloat16, torch.float16)


def scan(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor, modal: ModalTables, *,
         initial_state: torch.Tensor | None = None, output_final_state: bool = False, backend: str = "auto",
         chunk_size: int = 64, check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`spectral_scan` (same shapes, same arguments) with the modal tables as one ``ModalTables``
    (rho, theta, kc, ks, a: each [K, M]): the package's own call."""
    modal = ModalTables(*modal)
    validate_scan_inputs(v, write, read, clock, modal, initial_state)
    if check_values:
        if host_sync_allowed(v):
            validate_scan_values(clock, modal)
        else:
            clock, modal = poison_out_of_range(clock, modal)
    name = resolve_backend(backend, v)
    if v.shape[0] == 0:          # an empty batch: nothing to scan (the chunked paths reduce over the batch)
        state_dtype = torch.float32 if v.dtype in _HALF else v.dtype
        K, P, M = v.shape[2], v.shape[3], write.shape[-1]
        return torch.zeros_like(v), v.new_zeros((0, K, M, 2, P), dtype=state_dtype) if output_final_state else None
    if name == "fla":
        return fla_spectral_scan(v, write, read, clock, modal, initial_state, output_final_state)
    if name == "naive":
        return naive_spectral_scan(v, write, read, clock, *modal, initial_state, output_final_state)
    args = (write, read, clock, modal, initial_state, output_final_state)
    if v.dtype in _HALF:
        z, state = chunk_spectral_scan(v.float(), *args, chunk_size=chunk_size)
        return z.to(v.dtype), state
    return chunk_spectral_scan(v, *args, chunk_size=chunk_size)


def spectral_scan(
    v: torch.Tensor,  # [B, T, K, P] channel values
    write: torch.Tensor,  # [B, T, K, M] write gates eta^w in (0, 2)
    read: torch.Tensor,  # [B, T, K, M] read gates eta^r in (0, 2)
    clock: torch.Tensor,  # [B, T, K, M] clock increments Delta >= 0
    rho: torch.Tensor,  # [K, M] intrinsic decay in [0, 1]
    theta: torch.Tensor,  # [K, M] rotation frequency
    kc: torch.Tensor,  # [K, M] readout cosine coefficient
    ks: torch.Tensor,  # [K, M] readout sine coefficient
    a: torch.Tensor,  # [K, M] zero-lag correction coefficient
    initial_state: torch.Tensor | None = None,  # [B, K, M, 2, P] natural frame H(0)
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ESSH scan (Eq. 5) with the zero-lag correction (Eq. 24): returns ``z [B, T, K, P]`` (``v.dtype``) and
    ``H(T) [B, K, M, 2, P]`` in the natural frame (float32 for bf16/fp16 inputs; None unless
    ``output_final_state``). ``backend``: "auto" | "torch" | "fla" | "naive" (:func:`resolve_backend`);
    ``chunk_size``: the torch path's chunk length. ``check_values``: a ValueError for a negative clock, ``rho``
    outside [0, 1] or non-finite tables (one host sync; inside compiled regions those entries become NaN)."""
    return scan(v, write, read, clock, ModalTables(rho, theta, kc, ks, a), initial_state=initial_state,
                output_final_state=output_final_state, backend=backend, chunk_size=chunk_size,
                check_values=check_values)


def spectral_scan_step(v_t: torch.Tensor, write_t: torch.Tensor, read_t: torch.Tensor, clock_t: torch.Tensor,
                       modal: ModalTables, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the recurrence of Eq. 5 by one token: channel values ``v_t [B, K, P]``, write / read gates and clock
    increments ``write_t, read_t, clock_t [B, K, M]``, ``modal`` (rho, theta, kc, ks, a: each [K, M]) and the
    natural-frame ``state`` H(t-1) ``[B, K, M, 2, P]``, overwritten with H(t) in ``state.dtype`` (float32 for bf16
    models). Returns ``(z_t [B, K, P], state)``, ``z_t`` in ``v_t.dtype``."""
    modal = ModalTables(*modal)
    validate_scan_inputs(v_t, write_t, read_t, clock_t, modal, state, step=True)
    rho, theta, kc, ks, a = modal
    dt = state.dtype
    vt, w, r = v_t.to(dt), write_t.to(dt), read_t.to(dt)
    decay = rho.to(dt) * torch.exp(-clock_t.to(dt))  # [B, K, M]
    cos, sin = torch.cos(theta).to(dt), torch.sin(theta).to(dt)
    rot = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # [K, M, 2, 2]
    new = torch.matmul(decay[..., None, None] * rot, state)  # [B, K, M, 2, P]
    inject = w[..., None] * vt[:, :, None, :]  # [B, K, M, P] eta^w e1 v^T
    new = torch.cat([new[..., :1, :] + inject[..., None, :], new[..., 1:, :]], dim=-2)
    kappa = torch.stack([kc, -ks], -1).to(dt)  # [K, M, 2]
    z = torch.einsum("bkmx,bkmxp->bkp", r[..., None] * kappa, new)  # sum_i r_i H_i^T kappa_i
    z = z - (r * w * (a * kc).to(dt)).sum(-1, keepdim=True) * vt  # Eq. 24
    state.copy_(new)
    return z.to(v_t.dtype), state


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
