"""GPU path of the ESSH scan through fla-core's ``chunk_gla`` (the GLA identity of DESIGN.md / README.md).

Per channel k (a GLA head) and mode i (key dimensions ``2i, 2i+1``), positions ``t = 1..T``::

    q_i(t) = eta^r_i(t) R(-theta_i t) kappa_i              kappa_i = (kc_i, -ks_i)
    k_i(s) = eta^w_i(s) (cos theta_i s, -sin theta_i s)    = eta^w_i(s) R(-theta_i s) e1
    g_i(t) = log rho_i - Delta_i(t)                        on both key dimensions of mode i
    o(t)   = q(t)^T S(t),  S(t) = diag(exp g(t)) S(t-1) + k(t) v(t)^T,  scale 1

The GLA state is ``S_i(t) = R(-theta_i t) H_i(t)``; phases ``theta t mod 2 pi`` in float64; the zero-lag
correction (Eq. 24) is added outside the kernel. The mapping is pure torch, tested on CPU in float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .chunk_torch import _decay_scan, _rotated_frame, _rotation
from .gla_op import gla_chunk
from .inputs import ModalTables, capped_log_decay, isolate_nonfinite, isolating, restore_nonfinite
from .naive import naive_spectral_scan

GRAD_SEGMENT = 256   # with a theta gradient: segments of at most this many tokens (fla_spectral_scan)


def _absolute_phase(theta: torch.Tensor, T: int, period: int | None = None) -> torch.Tensor:
    """``theta t mod 2 pi`` for ``t = 1..T`` (with ``period`` L: t counted from each L-token segment's start, 1..L)
    in float64: ``[T, K, M]`` (differentiable in theta)."""
    t = torch.arange(T, dtype=torch.float64, device=theta.device)
    t = (t if period is None else torch.remainder(t, period)) + 1
    return torch.remainder(theta.double()[None] * t[:, None, None], 2 * math.pi)


def gla_inputs(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor, modal: ModalTables,
               initial_state: torch.Tensor | None = None, dtype: torch.dtype | None = None, period: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The scan's inputs (shapes of ``spectral_scan``; ``modal.a`` is used by gla_outputs) as GLA operands
    ``q, k [B, T, K, 2M]``, ``v [B, T, K, P]`` (in ``dtype``, default ``v.dtype``), ``g [B, T, K,
    2M]`` and ``h0 [B, K, 2M, P]`` (at least float32); key dimension ``2i + j`` is coordinate ``j`` of mode ``i``.
    With ``period`` L, the phases of q and k restart at each L-token segment (``_absolute_phase``)."""
    B, T, K, P = v.shape
    rho, theta, kc, ks, _ = modal
    M = rho.shape[-1]
    dtype = dtype or v.dtype
    wide = torch.promote_types(v.dtype, torch.float32)  # gates and tables before the final cast
    phase = _absolute_phase(theta, T, period)  # [T, K, M] float64
    cph, sph = torch.cos(phase).to(wide), torch.sin(phase).to(wide)
    qrot, krot = _rotated_frame(cph, sph, kc.to(wide), ks.to(wide))  # R(-theta t) kappa, R(-theta t) e1
    q = (read.to(wide)[..., None] * qrot).reshape(B, T, K, 2 * M).to(dtype)
    k = (write.to(wide)[..., None] * krot).reshape(B, T, K, 2 * M).to(dtype)
    # capped like the torch path (inputs.py): rho = 0 or an infinite clock is an exact reset (exp underflows to
    # 0 in fp32, also after fla's base-2 conversion), never -inf - (-inf) = NaN in fla's within-chunk cumsums
    g = -capped_log_decay(clock, rho, wide, wide)  # log rho - Delta, >= -cap
    g = g[..., None].expand(B, T, K, M, 2).reshape(B, T, K, 2 * M)
    h0 = None if initial_state is None else initial_state.to(wide).reshape(B, K, 2 * M, P)
    return q, k, v.to(dtype), g, h0


def gla_outputs(o: torch.Tensor, final_state: torch.Tensor | None, v: torch.Tensor, write: torch.Tensor,
                read: torch.Tensor, modal: ModalTables) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the GLA output ``o = q^T S`` [B, T, K, P], its state ``S(T)`` [B, K, 2M, P] (or None) and the scan's
    ``v, write, read, modal`` (theta, kc, a used): ``z = o - sum_i a_i r_i w_i kc_i v`` (Eq. 24) in ``v.dtype``
    and ``H(T) = R(theta T) S(T)`` or None."""
    B, T, K, P = v.shape
    theta, kc, a, M = modal.theta, modal.kc, modal.a, modal.theta.shape[-1]
    wide = torch.promote_types(v.dtype, torch.float32)
    corr = (read.to(wide) * write.to(wide) * (a * kc).to(wide)).sum(-1, keepdim=True)  # [B, T, K, 1]
    z = (o.to(wide) - corr * v.to(wide)).to(v.dtype)
    if final_state is None:
        return z, None
    rot = _rotation(theta.double() * T)  # [K, M, 2, 2], phase reduced mod 2 pi in float64
    S = final_state.reshape(B, K, M, 2, P)
    sdt = torch.promote_types(S.dtype, torch.float32)
    return z, torch.matmul(rot.to(sdt), S.to(sdt))  # [B, K, M, 2, P] natural frame


def _gla_scan(v, write, read, clock, modal, initial_state, output_final_state, compute_dtype):
    """One ``gla_chunk`` call over finite inputs (arguments of ``fla_spectral_scan``): ``(z, H(T) or None)``."""
    q, k, vv, g, h0 = gla_inputs(v, write, read, clock, modal, initial_state, compute_dtype)
    h0 = None if h0 is None else h0.float().contiguous()
    o, ht = gla_chunk(q, k, vv, g.float(), scale=1.0, initial_state=h0, output_final_state=output_final_state)
    return gla_outputs(o, ht if output_final_state else None, v, write, read, modal)


def _segment_scan(v, write, read, clock, modal, initial_state, output_final_state, compute_dtype, L):
    """The scan (arguments of ``fla_spectral_scan``, finite) as ``L``-token segments folded into the batch of one
    ``gla_chunk`` call, each from a zero state with phases from its own start (``period=L``). The states entering
    the segments, ``H_{j+1} = R(theta L_j) (F_j + diag(exp G_j(L_j)) H_j)`` (``F_j`` segment j's own final state,
    ``G_j(t)`` its log decay summed from its start through t), are a pure decay scan in the global frame
    ``R(-theta s_j) H_j`` (s_j: the tokens before segment j), run as chunk_torch's chunk boundaries are
    (``_decay_scan``); position t of segment j adds ``(q(t) * exp G_j(t))^T H_j``. ``(z, H(T) or None)``."""
    B, T, K, P = v.shape
    n, M, theta = -(-T // L), modal.theta.shape[-1], modal.theta.double()
    q, k, vv, g, h0 = gla_inputs(v, write, read, clock, modal, initial_state, compute_dtype, period=L)
    fold = lambda x: F.pad(x, (0, 0, 0, 0, 0, n * L - T)).reshape(B * n, L, K, x.shape[-1])  # noqa: E731 zeros: S kept
    q, g = fold(q), fold(g.float())
    o, fin = gla_chunk(q, k=fold(k), v=fold(vv), g=g, scale=1.0, output_final_state=True)
    G = g.view(B, n, L, K, 2 * M).cumsum(2)                                   # [B, n, L, K, 2M]; padding: g = 0
    starts = torch.arange(n, dtype=torch.float64, device=v.device) * L        # s_j
    to_global = _rotation(-theta[:, None, :] * starts[:, None]).float()       # [K, n, M, 2, 2]
    U = torch.matmul(to_global, fin.view(B, n, K, M, 2, P).transpose(1, 2))   # [B, K, n, M, 2, P]
    ell = -G[:, :, -1, :, ::2].double().permute(0, 2, 3, 1)                   # [B, K, M, n]: a mode's two keys alike
    h0 = None if h0 is None else h0.float().reshape(B, K, M, 2 * P)
    enter, last = _decay_scan(ell, U.transpose(2, 3).reshape(B, K, M, n, 2 * P), h0)
    enter = torch.matmul(to_global.mT, enter.reshape(B, K, M, n, 2, P).transpose(2, 3))  # [B, K, n, M, 2, P] natural
    wide = torch.promote_types(q.dtype, torch.float32)
    o_in = torch.einsum("bjlkm,bkjmp->bjlkp", q.view(B, n, L, K, 2 * M).to(wide) * G.exp().to(wide),
                        enter.reshape(B, K, n, 2 * M, P).to(wide))
    o = (o.view(B, n, L, K, P).to(wide) + o_in).reshape(B, n * L, K, P)[:, :T]
    z = gla_outputs(o, None, v, write, read, modal)[0]
    return z, (torch.matmul(_rotation(theta * T).float(), last.view(B, K, M, 2, P)) if output_final_state else None)


def fla_spectral_scan(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor,
                      modal: ModalTables, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      compute_dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scan (shapes of ``spectral_scan``) through fla's chunked GLA kernels (CUDA; differentiable): ``z`` in
    ``v.dtype``, the state in float32. ``q, k, v`` go to the kernel in ``compute_dtype`` (default float32 also for
    bf16 inputs: an accurate theta gradient; None: ``v.dtype``). With a theta gradient, ``GRAD_SEGMENT``-token segments
    with phases from their own starts (``_segment_scan``): ``d theta = sum_t t d phase_t`` then scales fla's (TF32)
    dq, dk errors by at most that, not T."""
    if (T := v.shape[1]) == 0:
        return naive_spectral_scan(v, write, read, clock, *modal, initial_state, output_final_state)
    z_bad = state_bad = None
    if isolating(v):     # once for the whole sequence: the segments see finite inputs
        v, write, read, clock, initial_state, z_bad, state_bad = isolate_nonfinite(v, write, read, clock, initial_state)
    args = (v, write, read, clock, modal, initial_state, output_final_state, compute_dtype)
    segmented = T > GRAD_SEGMENT and torch.is_grad_enabled() and modal.theta.requires_grad
    z, state = _segment_scan(*args, GRAD_SEGMENT) if segmented else _gla_scan(*args)
    return restore_nonfinite(z, state, z_bad, state_bad)
