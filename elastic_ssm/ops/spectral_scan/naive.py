"""Tokenwise reference of the ESSH selective spectral scan: the specification every fast path must match.

For each channel k and mode i (ESSH paper, Eq. 5/9 and Eq. 24)::

    H_i(t) = rho_i exp(-Delta_i(t)) R(theta_i) H_i(t-1) + eta^w_i(t) e1 v(t)^T        # [2, P]
    z(t)   = sum_i eta^r_i(t) H_i(t)^T kappa_i - sum_i a_i eta^r_i(t) eta^w_i(t) kc_i v(t)

with kappa_i = (kc_i, -ks_i) and R(th) = [[cos th, -sin th], [sin th, cos th]]. Plain loop, dtype-generic
(the tests run it in float64), differentiable by autograd."""

from __future__ import annotations

import torch

from .inputs import ModalTables, validate_scan_inputs


def naive_spectral_scan(
    v: torch.Tensor,  # [B, T, K, P] channel values
    write: torch.Tensor,  # [B, T, K, M] write gates eta^w in (0, 2)
    read: torch.Tensor,  # [B, T, K, M] read gates eta^r in (0, 2)
    clock: torch.Tensor,  # [B, T, K, M] clock increments Delta > 0
    rho: torch.Tensor,  # [K, M] intrinsic decay in (0, 1)
    theta: torch.Tensor,  # [K, M] rotation frequency
    kc: torch.Tensor,  # [K, M] cosine readout coefficient
    ks: torch.Tensor,  # [K, M] sine readout coefficient
    a: torch.Tensor,  # [K, M] zero-lag correction coefficient (Eq. 24)
    initial_state: torch.Tensor | None = None,  # [B, K, M, 2, P] natural frame H(0)
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Evaluate the recurrence of Eq. 5 token by token; returns ``z [B, T, K, P]`` and ``H(T)`` or None.
    Shapes are checked (a ValueError names the argument); values are taken as they are (the specification)."""
    validate_scan_inputs(v, write, read, clock, ModalTables(rho, theta, kc, ks, a), initial_state)
    B, T, K, P = v.shape
    M = rho.shape[-1]
    if initial_state is None:
        h0 = v.new_zeros(B, K, M, P)  # first coordinate of H
        h1 = v.new_zeros(B, K, M, P)  # second coordinate of H
    else:
        h0, h1 = initial_state[..., 0, :], initial_state[..., 1, :]
    cos = torch.cos(theta)[..., None]  # [K, M, 1]
    sin = torch.sin(theta)[..., None]
    outs = []
    for t in range(T):
        decay = (rho * torch.exp(-clock[:, t]))[..., None]  # [B, K, M, 1]
        w = write[:, t, :, :, None]  # [B, K, M, 1]
        r = read[:, t, :, :, None]
        vt = v[:, t, :, None, :]  # [B, K, 1, P]
        h0, h1 = (
            decay * (cos * h0 - sin * h1) + w * vt,  # Eq. 5: rotate, decay, inject along e1
            decay * (sin * h0 + cos * h1),
        )
        core = (r * (kc[..., None] * h0 - ks[..., None] * h1)).sum(-2)  # H^T kappa, summed over modes
        corr = (r * w * (a * kc)[..., None] * vt).sum(-2)  # Eq. 24 zero-lag correction
        outs.append(core - corr)
    z = torch.stack(outs, dim=1) if T > 0 else v.new_zeros(B, 0, K, P)  # [B, T, K, P]
    state = torch.stack([h0, h1], dim=-2) if output_final_state else None  # [B, K, M, 2, P]
    return z, state
