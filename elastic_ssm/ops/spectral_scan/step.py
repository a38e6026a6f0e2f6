"""Single-token decode step of the ESSH scan (Algorithm 4, lines 10-14; Appendix O.3): Eq. 5 and 24 of
``naive.py`` for one token of every channel and mode in plain torch, the state updated in place.
"""

from __future__ import annotations

import torch

from .inputs import ModalTables, validate_scan_inputs


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
