"""Chunked parallel ESSH scan in vectorised PyTorch (ESSH paper Algorithm 2, Appendix O.1): the CPU path.

Chunks of C positions carry only the 2 M P boundary state per channel (Eq. 28); diagonal blocks are factorised
through centred endpoint factors (Eq. 34, admitted per mode by Appendix O.2) or built pairwise; the scans over
blocks and chunks are lower-triangular matmuls (``_decay_scan``). The math: README.md."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .inputs import ModalTables, capped_log_decay, host_sync_allowed, isolate_nonfinite, isolating, restore_nonfinite

SUB_BLOCK = 16  # diagonal-block length when a whole chunk cannot be factorised


def _safe_exponent(dtype) -> float:
    """``E_safe`` of Appendix O.2 (eps = 2e-3): the largest log-decay span a factorised block may have."""
    fi, eps = torch.finfo(dtype), 2e-3
    return min(math.log(fi.max * eps), -math.log(fi.tiny / eps))


def _plan(L: torch.Tensor, diagonal: str, limit: float) -> tuple[int, torch.Tensor | None, str]:
    """Diagonal-block length ``c``, the ``[K, M]`` mask of factorised modes (None unless "mixed") and the kind
    ("factorized" | "pairwise" | "mixed") for the within-chunk log-decay ``L [B, K, N, C, M]`` (float64). Where no
    host sync may run (compiling, capturing) "auto" takes the pairwise plan, exact for every decay."""
    if diagonal not in ("auto", "factorized", "pairwise"):
        raise ValueError(f"diagonal must be 'auto', 'factorized' or 'pairwise', got {diagonal!r}")
    C = L.shape[-2]
    sub = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    if not host_sync_allowed(L):
        return (C, None, "factorized") if diagonal == "factorized" else (sub, None, "pairwise")
    if diagonal != "pairwise" and float(L[..., -1, :].detach().max()) <= limit:
        return C, None, "factorized"  # the usual training case: one factorised block per chunk
    if diagonal == "factorized":
        raise ValueError(f"diagonal='factorized' needs every chunk's log-decay span <= {limit:.1f} for this "
                         "dtype; use diagonal='auto'")
    if diagonal == "pairwise":
        return sub, None, "pairwise"
    ends = L[..., sub - 1 :: sub, :].detach()  # [B, K, N, C/c, M]
    span = ends - F.pad(ends[..., :-1, :], (0, 0, 1, 0))
    keep = span.amax(dim=(0, 2, 3)) <= limit  # [K, M]
    if bool(keep.all()):
        return sub, None, "factorized"
    return (sub, None, "pairwise") if not bool(keep.any()) else (sub, keep, "mixed")


def _lag_table(theta, kc, ks, sub: int, dtype) -> torch.Tensor:
    """``Psi[k, t, s, i] = kc cos(theta (t - s)) - ks sin(theta (t - s))`` for ``s <= t``, else 0 (Eq. 12)."""
    lag = torch.arange(sub, dtype=torch.float64, device=theta.device)
    ang = lag[None, :, None] * theta.double()[:, None, :]  # [K, c, M]
    psi = kc.double()[:, None, :] * torch.cos(ang) - ks.double()[:, None, :] * torch.sin(ang)
    diff = lag[:, None] - lag[None, :]  # [c, c] lag t - s
    table = psi[:, diff.clamp(min=0).long(), :]  # [K, c, c, M]
    return (table * (diff >= 0).to(table.dtype)[None, :, :, None]).to(dtype)


class _PairwiseDiagonal(torch.autograd.Function):
    """``G[t, s] = r(t) w(s) exp(-(l(t) - l(s))) psi(t - s)`` of one mode per diagonal block (Eq. 27).

    Only non-positive exponents (``max(0, l(t) - l(s))``; above the diagonal ``psi = 0``), so always finite.
    Inputs ``lq, r, w [B, n, N, nc, c]`` for n (channel, mode) pairs, ``psi [n, c, c]``."""

    @staticmethod
    def forward(ctx, lq, r, w, psi):
        e = torch.exp((lq[..., :, None] - lq[..., None, :]).clamp_(min=0).neg_())  # [B, n, N, nc, t, s]
        ctx.save_for_backward(e, r, w, psi)
        return e * psi[:, None, None] * w[..., None, :] * r[..., :, None]

    @staticmethod
    def backward(ctx, dG):
        e, r, w, psi = ctx.saved_tensors
        ed = e * dG  # dG E
        x = ed * psi[:, None, None]  # dG E psi
        dr = (x * w[..., None, :]).sum(-1)
        x.mul_(r[..., :, None])
        dw = x.sum(-2)
        x.mul_(w[..., None, :])  # dG r w E psi
        dlq = x.sum(-2) - x.sum(-1)
        dpsi = None
        if ctx.needs_input_grad[3]:
            dpsi = ed.mul_(r[..., :, None]).mul_(w[..., None, :]).sum((0, 2, 3))
        return dlq, dr, dw, dpsi


def _decay_scan(ell: torch.Tensor, U: torch.Tensor, h0: torch.Tensor | None, group: int = 64):
    """Scan ``h_j = exp(-ell_j) h_{j-1} + U_j`` (``h_{-1} = h0``) without a Python loop over j.

    ``ell [..., N]`` float64 log-decays >= 0, ``U [..., N, X]``, ``h0 [..., X]`` or None. Returns the states
    entering every step ``[..., N, X]`` (``h_{j-1}``) and the last state ``[..., X]``. Up to ``group`` steps
    are combined by one matmul with ``exp(-(l_{j-1} - l_i))`` for ``i < j`` (non-positive exponents);
    longer scans recurse on groups of ``group`` steps."""
    N = ell.shape[-1]
    if N > group:
        G = -(-N // group)
        pad = G * group - N  # padding neither decays nor writes
        ell_g = F.pad(ell, (0, pad)).reshape(*ell.shape[:-1], G, group)
        U_g = F.pad(U, (0, 0, 0, pad)).reshape(*U.shape[:-2], G, group, U.shape[-1])
        inside, last = _decay_scan(ell_g, U_g, None, group)  # [..., G, g, X], [..., G, X]
        enter, final = _decay_scan(ell_g.sum(-1), last, h0, group)  # [..., G, X]
        lead = torch.exp(-(torch.cumsum(ell_g, -1) - ell_g)).to(U.dtype)[..., None]  # group start -> j-1
        states = (inside + lead * enter[..., None, :]).reshape(*U.shape[:-2], G * group, U.shape[-1])
        return states[..., :N, :], final
    Lc = torch.cumsum(ell, -1)  # l_j
    Lprev = F.pad(Lc, (1, 0))  # l_{j-1} for j = 0..N (the last row gives the final state)
    lower = torch.ones(N + 1, N, dtype=torch.bool, device=ell.device).tril(-1)  # i < j
    expo = (Lprev[..., :, None] - Lc[..., None, :]).clamp(min=0)
    out = torch.matmul(torch.where(lower, torch.exp(-expo), 0).to(U.dtype), U)  # [..., N + 1, X]
    if h0 is not None:
        out = out + torch.exp(-Lprev).to(U.dtype)[..., None] * h0[..., None, :]
    return out[..., :N, :], out[..., N, :]


def _rotation(phase: torch.Tensor) -> torch.Tensor:
    """``R(phase)`` for a float64 phase tensor: ``[..., 2, 2]``; the phase is reduced mod 2 pi first."""
    phase = torch.remainder(phase, 2 * math.pi)
    c, s = torch.cos(phase), torch.sin(phase)
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)


def _rotated_frame(cph: torch.Tensor, sph: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor):
    """``R(-phase) kappa`` and ``R(-phase) e1`` ``[..., M, 2]`` from the phase's cos / sin (kappa = (kc, -ks))."""
    return torch.stack([cph * kc - sph * ks, -(sph * kc + cph * ks)], -1), torch.stack([cph, -sph], -1)


def _autocast_off(fn):
    """Run ``fn(v, ...)`` with autocast disabled on ``v``'s device type (see :func:`chunk_spectral_scan`)."""
    @functools.wraps(fn)
    def wrapped(v: torch.Tensor, *args, **kwargs):
        with torch.autocast(device_type=v.device.type, enabled=False):
            return fn(v, *args, **kwargs)

    return wrapped


@_autocast_off
def chunk_spectral_scan(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor,
                        modal: ModalTables, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                        chunk_size: int = 64, diagonal: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked scan (Algorithm 2) of validated inputs (shapes of ``spectral_scan``), the contract of
    :func:`naive_spectral_scan`: ``z [B, T, K, P]`` and ``H(T) [B, K, M, 2, P]`` or None, computed in ``v.dtype``
    also under autocast. ``diagonal`` ("auto" | "factorized" | "pairwise"): "auto" factorises every mode whose
    decay span admits it."""
    B, T, K, P = v.shape
    rho, theta, kc, ks, a = modal
    M = rho.shape[-1]
    dt, dev = v.dtype, v.device
    if T == 0:
        h = initial_state if initial_state is not None else v.new_zeros(B, K, M, 2, P)
        return v.new_zeros(B, 0, K, P), (h if output_final_state else None)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    C = min(chunk_size, -(-T // SUB_BLOCK) * SUB_BLOCK)  # short sequences do not pay for a full chunk
    N = -(-T // C)  # chunks; the time padding is N C - T
    pad = N * C - T
    z_bad = state_bad = None
    if isolating(v):  # NaN/Inf inputs stay where the spec puts them (inputs.py)
        v, write, read, clock, initial_state, z_bad, state_bad = isolate_nonfinite(v, write, read, clock, initial_state)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, K, X] -> [B, K, N, C, X], zero padded in time
        x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
        return x.permute(0, 2, 1, 3).reshape(B, K, N, C, x.shape[-1])

    # Per-position log-decay gamma + Delta (Eq. 34), float64, zero on padding; cumulative within each chunk.
    gamma = capped_log_decay(clock, rho, torch.float64, dt)  # rho = 0, Delta = inf: resets
    L = chunks(gamma).cumsum(-2)  # [B, K, N, C, M] l(tau), tau = 1..C
    limit = _safe_exponent(dt)
    sub, keep, kind = _plan(L, diagonal, limit)
    nc = C // sub
    vb = chunks(v).reshape(B, K, N, nc, sub, P)
    wb = chunks(write.to(dt)).reshape(B, K, N, nc, sub, M)
    rb = chunks(read.to(dt)).reshape(B, K, N, nc, sub, M)
    L = L.reshape(B, K, N, nc, sub, M)
    Lend = L[..., -1, :]  # [B, K, N, nc, M] log-decay from chunk start to each block end
    Lref = F.pad(Lend[..., :-1, :], (0, 0, 1, 0))  # ... to each block start (the position before it)
    lq = L - Lref[..., None, :]  # [B, K, N, nc, c, M] >= 0, log-decay since the block start
    span = (Lend - Lref)[..., None, :]  # [B, K, N, nc, 1, M]

    # Rotated chunk-local frame: phase theta * tau, tau = 1..C after the state entering the chunk.
    tau = torch.arange(1, C + 1, dtype=torch.float64, device=dev)
    phi = theta.double()[:, None, :] * tau[None, :, None]  # [K, C, M]
    cph, sph = torch.cos(phi), torch.sin(phi)
    qrot, krot = _rotated_frame(cph, sph, kc.double()[:, None, :], ks.double()[:, None, :])  # [K, C, M, 2]
    qrot, krot = (x.to(dt).reshape(K, 1, nc, sub, M, 2) for x in (qrot, krot))  # R(phi)^T kappa, R(phi)^T e1

    def keys(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:  # [.., c, M] -> [.., c, 2M] (mode-major)
        return torch.stack([x * rot[..., 0], x * rot[..., 1]], -1).flatten(-2)

    # Diagonal blocks (Eq. 27), core only: factorised modes through centred factors, the rest pairwise.
    G = None
    if kind != "pairwise":
        cen = (lq - 0.5 * span).clamp(-0.5 * limit, 0.5 * limit).to(dt)  # |cen| <= span / 2 when admitted
        qf = rb * torch.exp(-cen)
        if keep is not None:
            qf = qf * keep.to(dt)[:, None, None, None, :]
        kf = keys(wb * torch.exp(cen), krot)
        G = torch.tril(torch.matmul(keys(qf, qrot), kf.mT))  # [B, K, N, nc, t, s]
    if kind != "factorized":
        pairs = None if keep is None else (~keep).flatten().nonzero().squeeze(-1)  # pairs evaluated pairwise

        def pick(x: torch.Tensor) -> torch.Tensor:  # [B, K, N, nc, c, M] -> [B, pairs, N, nc, c]
            x = x.movedim(-1, 2).reshape(B, K * M, N, nc, sub)
            return x if pairs is None else x[:, pairs]

        psi = _lag_table(theta, kc, ks, sub, dt).movedim(-1, 1).reshape(K * M, sub, sub)
        psi = psi if pairs is None else psi[pairs]
        Gp = _PairwiseDiagonal.apply(pick(lq).to(dt), pick(rb), pick(wb), psi)  # [B, pairs, N, nc, t, s]
        if pairs is None:
            G = Gp.reshape(B, K, M, N, nc, sub, sub).sum(2)
        else:
            G = G.index_add(1, torch.div(pairs, M, rounding_mode="floor"), Gp)
    corr = (rb * wb * (a * kc).to(dt)[:, None, None, None, :]).sum(-1, keepdim=True)  # Eq. 24
    z = torch.matmul(G, vb) - corr * vb  # [B, K, N, nc, c, P]

    q = keys(rb * torch.exp(-lq).to(dt), qrot)  # [B, K, N, nc, c, 2M] reads states entering the block
    k = keys(wb * torch.exp(lq - span).to(dt), krot)  # writes decayed to the block end
    S = torch.matmul(k.mT, vb)  # [B, K, N, nc, 2M, P] each block's own writes, at its end

    # Block scan inside every chunk (all chunks at once): the chunk's own writes entering each block.
    S = S.reshape(B, K, N, nc, M, 2 * P).transpose(3, 4)  # [B, K, N, M, nc, 2P]
    Hloc, Uloc = _decay_scan((Lend - Lref).transpose(-1, -2), S, None)  # [.., nc, 2P], [B, K, N, M, 2P]

    # Boundary recurrence over chunks (Algorithm 2, lines 20-22) in the global rotated frame
    # S(t) = R(-theta t) H(t), where a chunk step is a pure decay; phases theta * t mod 2 pi in float64.
    starts = torch.arange(N, dtype=torch.float64, device=dev) * C  # b_j - 1
    to_global = _rotation(-theta.double()[:, None, :] * starts[:, None]).to(dt)  # [K, N, M, 2, 2]
    U = torch.matmul(to_global, Uloc.reshape(B, K, N, M, 2, P))  # [B, K, N, M, 2, P]
    h0 = None if initial_state is None else initial_state.to(dt).reshape(B, K, M, 2 * P)
    U = U.transpose(2, 3).reshape(B, K, M, N, 2 * P)
    Henter, h = _decay_scan(Lend[..., -1, :].transpose(-1, -2), U, h0)  # global frame
    Henter = torch.matmul(to_global.mT, Henter.reshape(B, K, M, N, 2, P).transpose(2, 3))  # natural, b_j - 1

    # Every block reads the entering chunk state decayed to its start plus the chunk's older writes.
    Hsub = torch.exp(-Lref).to(dt).transpose(-1, -2)[..., None] * Henter.reshape(B, K, N, M, 1, 2 * P)
    if nc > 1:
        Hsub = Hsub + Hloc
    Hsub = Hsub.reshape(B, K, N, M, nc, 2, P).permute(0, 1, 2, 4, 3, 5, 6).reshape(B, K, N, nc, 2 * M, P)
    z = z + torch.matmul(q, Hsub)  # [B, K, N, nc, c, P]
    z = z.reshape(B, K, N * C, P)[:, :, :T].permute(0, 2, 1, 3)  # [B, T, K, P]
    state = None
    if output_final_state:  # H(T) = R(theta T) S(T); padding neither decays nor writes
        to_natural = _rotation(theta.double() * T).to(dt)  # [K, M, 2, 2]
        state = torch.matmul(to_natural, h.reshape(B, K, M, 2, P))  # [B, K, M, 2, P]
    return restore_nonfinite(z, state, z_bad, state_bad)
