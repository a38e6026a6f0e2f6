"""The ESSH selective spectral scan (ESSH paper Sec. 4.1/4.3, Eq. 5 and 24, Appendix O): a stateless op.

``spectral_scan`` checks its inputs and dispatches to the chunked PyTorch scan (``"torch"``, Algorithm 2),
fla's GLA kernels (``"fla"``) or the spec (``"naive"``); inside the package the five modal tables travel as one
``ModalTables`` (``scan``). ``spectral_scan_step``: the single-token decode step (Algorithm 4, lines 10-14;
Appendix O.3) in plain torch. Math and edge values: README.md beside this file."""

from __future__ import annotations

import torch

from ..dispatch import resolve_backend
from .chunk_fla import fla_spectral_scan
from .chunk_torch import chunk_spectral_scan
from .inputs import ModalTables, host_sync_allowed, poison_out_of_range, validate_scan_inputs, validate_scan_values
from .naive import naive_spectral_scan

__all__ = ["ModalTables", "chunk_spectral_scan", "naive_spectral_scan", "scan", "spectral_scan", "spectral_scan_step",
           "validate_scan_inputs", "validate_scan_values"]

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
