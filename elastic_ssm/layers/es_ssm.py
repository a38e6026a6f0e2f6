"""ES-SSM spectral sublayer and pre-norm residual block (ES-SSM paper Sec. 4.1, Eq. 4; Figure 1), with its cached
decoding.

At runtime budget K <= K-bar (Eq. 4)::

    s(t)   = W_g2 GELU(W_g1 u(t) + b_g1) + b_g2                      gate logits, first K rows only
    g_k(t) = sigmoid(s_k(t)) / sqrt(K)
    S_K(u)(t) = sum_{k=1}^{K} g_k(t) M_k (Phi_k * u)(t)

``Phi_k``: fixed Hankel filters (buffer ``filters`` [K-bar, L]); ``M_k``: columns k d .. (k + 1) d of
``proj.weight``, applied after the gate. ``ESSSMBlock``: ``r += DropPath(S_K(LN1(r)))``, then
``r += DropPath(FFN(LN2(r)))`` with a GELU FFN d -> ffn_mult d -> d.

Decoding, Eq. 4 per token (docs/es_ssm.md, "Decoding"): ``decode="exact"`` keeps the last L - 1 inputs;
``decode="modal"`` replaces each filter by its m-mode matrix-pencil fit (ESSH Eq. 4, 5; ``DecodePlan``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ESSSMConfig
from ..elastic.slicing import empty_linear, linear, linear_weight, prefix
from ..elastic.tiers import tier_width
from ..ops.fft_conv import fft_causal_conv
from ..spectral import DampedModes, fit_damped_modes, hankel_filters

__all__ = ["SpectralSublayer", "ESSSMBlock", "GeluFFN", "DropPath", "DecodePlan", "SpectralDecodeState", "check_decode"]


class DropPath(nn.Module):
    """Stochastic depth: zero the whole residual branch of a sample with probability ``p`` (training only)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropPath rate must lie in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [B, ...]
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)  # [B, 1, ..., 1]
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GeluFFN(nn.Module):
    """Tokenwise FFN ``fc2(dropout(GELU(fc1 x)))`` with exact (erf) GELU and biases, d -> n_ff -> d."""

    def __init__(self, d_model: int, n_ff: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, n_ff)
        self.fc2 = nn.Linear(n_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


def check_decode(decode: object, n_modes: object, L: int) -> tuple[str, int]:
    """Validate a decode mode and mode count for filters of length L; one-line ``ValueError`` otherwise."""
    if decode not in ("exact", "modal"):
        raise ValueError(f"unknown decode mode {decode!r}; use 'exact' (ring buffer, default) or 'modal'"
                         " (m damped modes per channel, constant memory)")
    if isinstance(n_modes, bool) or not isinstance(n_modes, int) or not 1 <= n_modes <= max(1, L // 4):
        raise ValueError(f"n_modes={n_modes!r} must be an int in [1, L/4 = {L // 4}] for filters of length"
                         f" L={L} (the matrix-pencil rank); pass fewer modes")
    return str(decode), n_modes


@functools.cache
def _fit_row(row: bytes, n_modes: int) -> DampedModes:
    """``fit_damped_modes`` of one float64 filter (its bytes), cached in-process by its bytes and m."""
    return fit_damped_modes(np.frombuffer(row, dtype=np.float64), n_modes)


@dataclass(frozen=True)
class DecodePlan:
    """Constants of one sublayer's decoder at budget K (not in ``nbytes``), in the state dtype unless said.
    exact: ``phi0`` [K] (lag-0 taps), ``window`` [K, 2S-1] (the reversed filter tail, doubled). modal: ``a = rho
    cos theta``, ``b = rho sin theta``, ``kc``, ``ks`` [K, M, 1]; ``filters`` [K, L] the fitted filters (filters'
    dtype); ``rho``, ``theta`` [K, M] float64 (prefill phases); ``errors`` [K] the fit errors ``||fit - phi_k|| /
    ||phi_k||`` (ESSH App. B.7 epsilon_k^(m))."""

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


class SpectralSublayer(nn.Module):
    """The ES-SSM spectral sublayer S_K of Eq. 4 of width ``d_model``, full budget ``n_channels`` (K-bar),
    filter length ``seq_len`` (the longest sequence), gate-MLP width ``gate_hidden`` (paper: d / 2), initial
    b_g2 ``gate_bias_init`` (paper: -2) and ``init_std`` for W_g1, W_g2 and M_k."""

    def __init__(self, d_model: int, n_channels: int, seq_len: int, gate_hidden: int, gate_bias_init: float = -2.0,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.d_model, self.n_channels, self.seq_len = d_model, n_channels, seq_len
        self.gate_bias_init, self.init_std = gate_bias_init, init_std
        self.gate_in = nn.Linear(d_model, gate_hidden)  # W_g1 [d_g, d], b_g1 [d_g]
        self.gate_out = nn.Linear(gate_hidden, n_channels)  # W_g2 [K, d_g], b_g2 [K]
        self.proj = empty_linear(n_channels * d_model, d_model)  # weight [d, K d]: M_k = columns k d .. (k+1) d
        self.register_buffer("filters", torch.empty(n_channels, seq_len), persistent=True)  # [K, L]
        if self.filters.device.type != "meta":     # the first K-bar Hankel eigenfilters (float64, App. B.3)
            self.filters.copy_(torch.from_numpy(hankel_filters(seq_len, n_channels)[1]))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, zero b_g1, b_g2 = gate_bias_init (Sec. 4.1). Filters untouched."""
        if self.proj.weight.device.type == "meta":
            return
        for w in (self.gate_in.weight, self.gate_out.weight):
            nn.init.normal_(w, std=self.init_std)
        with torch.no_grad():   # drawn as the [K, d_in, d_out] stack of M_k^T of the layout before nn.Linear
            K, D = self.n_channels, self.d_model
            self.proj.weight.copy_(self.proj.weight.new_empty(K * D, D).normal_(std=self.init_std).t())
        nn.init.zeros_(self.gate_in.bias)
        nn.init.constant_(self.gate_out.bias, self.gate_bias_init)

    def gates(self, u: torch.Tensor, K: int) -> torch.Tensor:
        """g_k(t) = sigmoid(s_k(t)) / sqrt(K) for k <= K; u [B, T, D] -> [B, T, K]."""
        h = F.gelu(self.gate_in(u))  # [B, T, d_g], exact (erf) GELU
        s = linear(self.gate_out, h, rows=K)  # [B, T, K]
        return torch.sigmoid(s) * (1.0 / math.sqrt(K))

    def channel_outputs(self, u: torch.Tensor, K: int | None = None) -> torch.Tensor:
        """Figure 1's z_k(t) = g_k(t) M_k (Phi_k * u)(t), [B, T, K, D] (a diagnostic); they sum to ``forward``."""
        K = self.n_channels if K is None else K
        g = self.gates(u, K)  # [B, T, K]
        x = fft_causal_conv(u, prefix(self.filters, K))  # [B, T, K, D]
        m = linear_weight(self.proj, cols=K * self.d_model).unflatten(1, (K, -1)).permute(1, 2, 0)  # [K, Din, Dout]
        return torch.einsum("btki,kio->btko", (x * g.unsqueeze(-1)).to(m.dtype), m)

    def forward(self, u: torch.Tensor, K: int | None = None, phi: torch.Tensor | None = None) -> torch.Tensor:
        """S_K(u) of Eq. 4: u [B, T, D] -> [B, T, D]; ``phi`` [K, L] replaces the first K filters (modal decoding)."""
        K = self.n_channels if K is None else K
        self._check_budget(K)
        B, T, D = u.shape
        g = self.gates(u, K)  # [B, T, K]
        phi = prefix(self.filters, K) if phi is None else phi  # [K, L]
        x = fft_causal_conv(u, phi)  # [B, T, K, D], memory [B, K, D, T]
        xg = x.permute(0, 2, 3, 1) * g.transpose(1, 2).unsqueeze(2)  # [B, K, D, T] gate before projection
        xg = xg.reshape(B, K * D, T).transpose(1, 2)  # [B, T, K*D]
        return linear(self.proj, xg, cols=K * D)  # [B, T, D]

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
        phi64 = phi.detach().to("cpu", torch.float64).contiguous()  # [K, L]
        fits = [_fit_row(row.tobytes(), n_modes) for row in phi64.numpy()]  # matrix-pencil fits, m = n_modes
        rho, theta, kc, ks = (torch.from_numpy(np.stack([getattr(f, k) for f in fits]))   # [K, M] float64
                              for k in ("rho", "theta", "kc", "ks"))
        recon = torch.from_numpy(np.stack([f.filter(phi.shape[1]) for f in fits]))  # [K, L], ESSH Eq. 4
        dev = phi.device
        cast = lambda x: x.to(device=dev, dtype=dtype).unsqueeze(-1)  # [K, M, 1]
        tensors = {"a": cast(rho * torch.cos(theta)), "b": cast(rho * torch.sin(theta)), "kc": cast(kc),
                   "ks": cast(ks), "rho": rho.to(dev), "theta": theta.to(dev),
                   "filters": recon.to(device=dev, dtype=self.filters.dtype)}
        return DecodePlan("modal", K, tensors, (recon - phi64).norm(dim=1) / phi64.norm(dim=1))

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

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_channels={self.n_channels}, seq_len={self.seq_len}"


class ESSSMBlock(nn.Module):
    """Pre-norm residual ES-SSM block (Sec. 4.1): spectral sublayer then GELU FFN, DropPath on both."""

    def __init__(self, cfg: ESSSMConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.mixer = SpectralSublayer(d, cfg.n_channels, cfg.seq_len, cfg.gate_hidden, cfg.gate_bias_init, cfg.init_std)
        self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.ffn = GeluFFN(d, cfg.ffn_mult * d, cfg.dropout)
        self.drop_path = DropPath(cfg.drop_path)
        self.init_std = cfg.init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """LayerNorms to (1, 0); FFN weights Normal(0, init_std), biases 0; the sublayer as its own."""
        if self.ln1.weight.device.type == "meta":
            return
        self.ln1.reset_parameters()
        self.ln2.reset_parameters()
        for lin in (self.ffn.fc1, self.ffn.fc2):
            nn.init.normal_(lin.weight, std=self.init_std)
            nn.init.zeros_(lin.bias)
        self.mixer.reset_parameters()

    def forward(self, r: torch.Tensor, K: int | None = None, valid: torch.Tensor | None = None,
                state: SpectralDecodeState | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]; ``valid`` [B, T] zeroes the sublayer input at padding (it never enters a
        convolution); a ``state`` (this block's cache slice) is filled by the prefill."""
        u = self.ln1(r)  # [B, T, D]
        if valid is not None:
            u = u * valid.unsqueeze(-1).to(u.dtype)
        h = self.mixer(u, K) if state is None else self.mixer.prefill(u, state)
        r = r + self.drop_path(h)
        return r + self.drop_path(self.ffn(self.ln2(r)))

    def step(self, x: torch.Tensor, state: SpectralDecodeState, tier=None) -> torch.Tensor:
        """One token at time ``state.t``: x [B, D] -> [B, D]; the mixer state advances in place."""
        x = x + self.mixer.step(self.ln1(x), state, tier)
        return x + self.ffn(self.ln2(x))
