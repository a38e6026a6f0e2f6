"""ES-SSM spectral sublayer and pre-norm residual block (ES-SSM paper Sec. 4.1, Eq. 4; Figure 1).

At runtime budget K <= K-bar (Eq. 4)::

    s(t)   = W_g2 GELU(W_g1 u(t) + b_g1) + b_g2                      gate logits, first K rows only
    g_k(t) = sigmoid(s_k(t)) / sqrt(K)
    S_K(u)(t) = sum_{k=1}^{K} g_k(t) M_k (Phi_k * u)(t)

``Phi_k``: fixed Hankel filters (buffer ``filters`` [K-bar, L]); ``M_k``: columns k d .. (k + 1) d of
``proj.weight``, applied after the gate. ``ESSSMBlock``: ``r += DropPath(S_K(LN1(r)))``, then
``r += DropPath(FFN(LN2(r)))`` with a GELU FFN d -> ffn_mult d -> d.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ESSSMConfig
from ..elastic.slicing import empty_linear, linear, linear_weight, prefix
from ..ops.fft_conv import fft_causal_conv
from .es_ssm_decode import SpectralDecodeMixin, SpectralDecodeState

__all__ = ["SpectralSublayer", "ESSSMBlock", "GeluFFN", "DropPath", "hankel_filter_tensor", "on_meta_device"]


def on_meta_device() -> bool:
    """True inside ``with torch.device("meta")`` (where parameters must not be initialised)."""
    return torch.empty(0).device.type == "meta"


def hankel_filter_tensor(seq_len: int, n_channels: int) -> torch.Tensor:
    """The first ``n_channels`` Hankel eigenfilters of length ``seq_len`` (float64, App. B.3) as float32 [K, L]."""
    from ..spectral import hankel_filters

    _, phi = hankel_filters(seq_len, n_channels)  # numpy float64 [K, L]
    return torch.from_numpy(phi).to(torch.float32).contiguous()


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


class SpectralSublayer(SpectralDecodeMixin, nn.Module):
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
        if not on_meta_device():
            self.filters.copy_(hankel_filter_tensor(seq_len, n_channels))
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
        if not on_meta_device():
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
