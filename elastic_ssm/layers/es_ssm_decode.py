"""Cached decoding of the ES-SSM spectral sublayer (ES-SSM paper Eq. 4): exact ring buffer and modal state.

``decode="exact"``: the last S = L - 1 inputs [B, S, D], read against the doubled, reversed filter tail
``window`` [K, 2S - 1]. ``decode="modal"``: each filter replaced by its m-mode matrix-pencil fit (ESSH Eq. 4,
App. C.1.1), a state [B, K, M, 2, D] (ESSH Eq. 5 with unit gates). docs/es_ssm.md, "Cached decoding".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..elastic.slicing import linear, prefix
from ..elastic.tiers import tier_width
from ..spectral import DampedModes, fit_damped_modes

__all__ = ["DECODE_MODES", "ModalFit", "DecodePlan", "SpectralDecodeState", "check_decode", "modal_fit",
           "SpectralDecodeMixin"]

#: The decode modes of ``ESSSM.allocate_cache``.
DECODE_MODES = ("exact", "modal")

_FITS: dict[tuple[str, int], DampedModes] = {}


def check_decode(decode: object, n_modes: object, L: int) -> tuple[str, int]:
    """Validate a decode mode and mode count for filters of length L; one-line ``ValueError`` otherwise."""
    if decode not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {decode!r}; use 'exact' (ring buffer, default) or 'modal'"
                         " (m damped modes per channel, constant memory)")
    if isinstance(n_modes, bool) or not isinstance(n_modes, int) or not 1 <= n_modes <= max(1, L // 4):
        raise ValueError(f"n_modes={n_modes!r} must be an int in [1, L/4 = {L // 4}] for filters of length"
                         f" L={L} (the matrix-pencil rank); pass fewer modes")
    return str(decode), n_modes


@dataclass(frozen=True)
class ModalFit:
    """m-mode fits of K filters, all float64: ``rho, theta, kc, ks`` [K, M], the fitted filters
    ``filters`` [K, L] (ESSH Eq. 4 sampled at lags 0..L-1) and the relative errors ``errors`` [K]
    (``||fit - phi_k|| / ||phi_k||``, ESSH App. B.7 epsilon_k^(m))."""

    rho: torch.Tensor
    theta: torch.Tensor
    kc: torch.Tensor
    ks: torch.Tensor
    filters: torch.Tensor
    errors: torch.Tensor


def _fit_row(row: np.ndarray, n_modes: int) -> DampedModes:
    """``fit_damped_modes`` of one float64 filter [L], cached in-process by its bytes and m."""
    key = (hashlib.sha1(row.tobytes()).hexdigest() + str(row.shape), n_modes)
    if key not in _FITS:
        _FITS[key] = fit_damped_modes(row, n_modes)
    return _FITS[key]


def modal_fit(filters: torch.Tensor, n_modes: int) -> ModalFit:
    """Matrix-pencil fits (``spectral.fit_damped_modes``) of the rows of ``filters`` [K, L], m = ``n_modes``;
    each row cached in-process by its bytes and m."""
    phi = filters.detach().to("cpu", torch.float64).contiguous()  # [K, L]
    fits = [_fit_row(row, n_modes) for row in phi.numpy()]
    t = lambda name: torch.from_numpy(np.stack([getattr(f, name) for f in fits]))  # [K, M]
    L = phi.shape[1]
    recon = torch.from_numpy(np.stack([f.filter(L) for f in fits]))  # [K, L]
    errors = (recon - phi).norm(dim=1) / phi.norm(dim=1)  # [K]
    return ModalFit(t("rho"), t("theta"), t("kc"), t("ks"), recon, errors)


@dataclass(frozen=True)
class DecodePlan:
    """Constants of one sublayer's decoder at budget K (not in ``nbytes``), in the state dtype unless said.
    exact: ``phi0`` [K] (lag-0 taps), ``window`` [K, 2S-1] (the reversed filter tail, doubled). modal: ``a = rho
    cos theta``, ``b = rho sin theta``, ``kc``, ``ks`` [K, M, 1]; ``filters`` [K, L] the fitted filters (filters'
    dtype); ``rho``, ``theta`` [K, M] float64 (prefill phases); ``errors`` [K] the fit errors."""

    mode: str
    K: int
    tensors: dict[str, torch.Tensor]
    errors: torch.Tensor | None = None


@dataclass
class SpectralDecodeState:
    """One sublayer's slice of an ES-SSM decode cache: ``buffer`` (exact: the ring of the last L-1 inputs
    [B, L-1, D]; modal: the mode states [B, K, M, 2, D]), the constants ``plan`` of its budget, and ``t``, the
    next time index (the padded prompt length plus the steps taken; every row shares it)."""

    buffer: torch.Tensor
    plan: DecodePlan
    t: int = 0


class SpectralDecodeMixin:
    """``decode_plan`` / ``init_state`` / ``prefill`` / ``step`` of ``SpectralSublayer`` (Eq. 4 per token),
    with the layer decode protocol of ESSH's mixers: ``init_state(batch, tier)``, ``step(x, state, tier)``."""

    def decode_plan(self, tier=None, decode: str = "exact", n_modes: int = 8,
                    dtype: torch.dtype = torch.float32) -> DecodePlan:
        """The precomputed constants of budget ``tier`` (an int K, a ``Tier`` or None: every channel) in
        ``dtype`` (the state dtype) on the filters' device."""
        K = tier_width(tier, self.n_channels)
        decode, n_modes = check_decode(decode, n_modes, self.seq_len)
        self._check_budget(K)
        phi = prefix(self.filters, K)  # [K, L]
        if decode == "exact":
            S = phi.shape[1] - 1
            tail = phi[:, 1:].to(dtype).flip(-1)  # [K, S], tail[:, j] = phi(S - j)
            window = torch.cat([tail, tail[:, :-1]], dim=1) if S else tail  # [K, 2S-1]
            return DecodePlan("exact", K, {"phi0": phi[:, 0].to(dtype), "window": window.contiguous()})
        fit = modal_fit(phi, n_modes)
        dev = phi.device
        cast = lambda x: x.to(device=dev, dtype=dtype).unsqueeze(-1)  # [K, M, 1]
        tensors = {"a": cast(fit.rho * torch.cos(fit.theta)), "b": cast(fit.rho * torch.sin(fit.theta)),
                   "kc": cast(fit.kc), "ks": cast(fit.ks), "rho": fit.rho.to(dev), "theta": fit.theta.to(dev),
                   "filters": fit.filters.to(device=dev, dtype=self.filters.dtype)}
        return DecodePlan("modal", K, tensors, fit.errors)

    def init_state(self, batch: int, tier=None, *, state_dtype: torch.dtype = torch.float32, decode: str = "exact",
                   n_modes: int = 8, plan: DecodePlan | None = None, **_: object) -> SpectralDecodeState:
        """Zero state at time 0: exact [B, L-1, D] ring buffer; modal [B, K, M, 2, D] mode states; ``plan``
        (default ``decode_plan(tier, decode, n_modes, state_dtype)``) of the same budget."""
        if plan is None:
            plan = self.decode_plan(tier, decode, n_modes, state_dtype)
        elif plan.K != tier_width(tier, plan.K):
            raise ValueError(f"a plan of budget K={plan.K} given for tier {tier!r}; build it with decode_plan(tier)")
        dev = self.filters.device
        if plan.mode == "exact":
            buf = torch.zeros(batch, self.seq_len - 1, self.d_model, dtype=state_dtype, device=dev)
        else:
            M = plan.tensors["a"].shape[1]
            buf = torch.zeros(batch, plan.K, M, 2, self.d_model, dtype=state_dtype, device=dev)
        return SpectralDecodeState(buf, plan)

    def _check_budget(self, K: int) -> None:
        if not 1 <= K <= self.n_channels:
            raise ValueError(f"budget K={K} is outside [1, {self.n_channels}]; pass a K this layer holds (1..K-bar)")

    def prefill(self, u: torch.Tensor, state: SpectralDecodeState) -> torch.Tensor:
        """Forward over a whole prompt ``u`` [B, T, D] (masked, T <= L) -> [B, T, D]; fills ``state`` for the next
        token (``state.t`` becomes T). modal: ``h_i(T-1) = sum_t z_i^(T-1-t) u(t)`` (phases in float64)."""
        plan, buf, T = state.plan, state.buffer, u.shape[1]
        K = plan.K
        state.t = T
        if plan.mode == "exact":
            y = self(u, K)  # [B, T, D]
            S = buf.shape[1]
            if S:
                n = min(T, S)
                slots = torch.arange(T - n, T, device=u.device) % S
                buf[:, slots] = u[:, T - n:].detach().to(buf.dtype)
            return y
        y = self(u, K, phi=plan.tensors["filters"])  # [B, T, D]
        n = torch.arange(T - 1, -1, -1, device=u.device, dtype=torch.float64)  # lags T-1-t, [T]
        rho, theta = plan.tensors["rho"], plan.tensors["theta"]  # [K, M] float64
        mag = rho.unsqueeze(-1) ** n  # [K, M, T]
        phase = theta.unsqueeze(-1) * n  # [K, M, T], float64 phase
        uu = u.detach().to(torch.float64)  # the state is not differentiated through
        buf[:, :, :, 0] = torch.einsum("kmt,btd->bkmd", mag * torch.cos(phase), uu).to(buf.dtype)
        buf[:, :, :, 1] = torch.einsum("kmt,btd->bkmd", mag * torch.sin(phase), uu).to(buf.dtype)
        return y

    def step(self, x: torch.Tensor, state: SpectralDecodeState, tier=None) -> torch.Tensor:
        """One token at time ``state.t``: x [B, D] -> S_K(x)(t) [B, D]; ``state`` advances in place (Eq. 4).
        ``tier`` (optional) must be the budget the state was built for."""
        plan, buf, t = state.plan, state.buffer, state.t
        K, D = plan.K, self.d_model
        if tier is not None and tier_width(tier, K) != K:
            raise ValueError(f"this decode state holds budget K={K}, the step asks for {tier!r}; allocate a cache "
                             "at that tier")
        B = x.shape[0]
        g = self.gates(x.unsqueeze(1), K)[:, 0]  # [B, K]
        us = x.to(buf.dtype)
        p = plan.tensors
        if plan.mode == "exact":
            z = p["phi0"].unsqueeze(-1) * us.unsqueeze(1)  # [B, K, D], lag 0
            S = buf.shape[1]
            if S:
                o = (-t) % S
                z = z + torch.matmul(p["window"][:, o:o + S], buf)  # [K, S] @ [B, S, D] -> [B, K, D]
                buf[:, t % S] = us
        else:
            re, im = buf[:, :, :, 0], buf[:, :, :, 1]  # [B, K, M, D]
            new_re = p["a"] * re - p["b"] * im + us[:, None, None, :]
            new_im = p["b"] * re + p["a"] * im
            re.copy_(new_re)
            im.copy_(new_im)
            z = (p["kc"] * new_re - p["ks"] * new_im).sum(2)  # [B, K, D], Re(sum_i c_i h_i)
        state.t = t + 1
        zg = (z * g.unsqueeze(-1).to(z.dtype)).reshape(B, K * D)  # [B, K*D], gate first
        return linear(self.proj, zg, cols=K * D).to(x.dtype)  # [B, D]
