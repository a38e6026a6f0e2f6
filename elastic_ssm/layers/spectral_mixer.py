"""Selective spectral mixer of ESSH (Sec. 4.1, Appendix C.1-C.4).

u [B,T,D] is the block's RMS-normed residual stream. ``in_proj`` (weight [K (P + 3M), D], channel-major: channel
k's P value rows v_k^0, then the write, read and clock rows of its M modes) gives every control; ``out_proj``
(weight [D, K P]) reads out; a tier keeps a row / column prefix. Per channel (channel-local, C.4):

    v_k   = (1 - beta_k) v_k^0 + beta_k v_k^0 / sqrt(|v_k^0|^2 / P + eps)            (Eq. 23)
    eta^w = 2 sigmoid(w^w u + b^w),  eta^r = 2 sigmoid(w^r u + b^r),  Delta = softplus(w^D u + b^D)  (C.2)
    rho   = exp(-softplus(rho_raw))                                                (C.3)
    z_k   = selective scan of Eq. 5 with zero-lag correction a (Eq. 24)            (ops.spectral_scan)
    y     = K^{-1/2} sum_{k<=K} W_k^out z_k                                         (Sec. 4.1)

Init: gate/clock weights 0, biases (0, 0, -3); modal tables from the matrix-pencil fit of the first K-bar Hankel
filters (C.1); a = 1/2; beta = 0. Padding (``valid`` False) zeroes the write gate."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..elastic.slicing import empty_linear, linear, linear_weight, prefix
from ..elastic.tiers import tier_width
from ..ops.spectral_scan import scan, spectral_scan_step
from ..ops.spectral_scan.decode_triton import ModalConstants
from ..ops.spectral_scan.inputs import ModalTables
from .decode_plan import SpectralPlan, in_by_out_copy


class SpectralMixer(nn.Module):
    def __init__(self, d_model: int, n_channels: int, n_modes: int, value_width: int, *,
                 filter_length: int = 2048, pole_clip: float = 1 - 1e-4, clock_bias_init: float = -3.0,
                 zero_lag_init: float = 0.5, blend_eps: float = 1e-6, init_std: float = 0.02,
                 out_std: float | None = None) -> None:
        super().__init__()
        K, M, P, D = n_channels, n_modes, value_width, d_model
        self.K, self.M, self.P, self.D = K, M, P, D
        self.filter_length, self.pole_clip = filter_length, pole_clip
        self.clock_bias_init, self.zero_lag_init, self.blend_eps = clock_bias_init, zero_lag_init, blend_eps
        self.init_std, self.out_std = init_std, out_std if out_std is not None else init_std
        self.in_proj = empty_linear(D, K * (P + 3 * M))   # weight [K(P+3M), D], channel-major rows
        self.gate_bias = nn.Parameter(torch.empty(K, 3, M))         # [K, 3, M] write/read/clock biases
        self.out_proj = empty_linear(K * P, D)             # weight [D, K P], channel-major columns
        for name in ("rho_raw", "theta", "kc", "ks", "a"):                 # modal tables [K, M]
            self.register_parameter(name, nn.Parameter(torch.empty(K, M)))
        self.beta = nn.Parameter(torch.empty(K))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.theta.device.type == "meta":
            return
        from ..spectral import modal_tables

        P = self.P
        w_in = self.in_proj.weight.view(self.K, P + 3 * self.M, self.D)   # [K, P+3M, D]
        nn.init.normal_(w_in[:, :P], std=self.init_std)
        w_in[:, P:].zero_()
        self.gate_bias.zero_()
        self.gate_bias[:, 2].fill_(self.clock_bias_init)
        # drawn in the [K, P, D] order of the layout before nn.Linear, so a seed gives the same model
        self.out_proj.weight.copy_(self.out_proj.weight.new_empty(self.K * P, self.D).normal_(std=self.out_std).t())
        tab = modal_tables(self.filter_length, self.K, self.M, clip=self.pole_clip)
        rho = torch.as_tensor(tab["rho"], dtype=torch.float64).clamp(1e-6, self.pole_clip)  # rho=0 fits stay finite
        gamma = -torch.log(rho)                                      # rho = exp(-softplus(rho_raw))
        self.rho_raw.copy_(torch.log(torch.expm1(gamma)))
        for name in ("theta", "kc", "ks"):
            getattr(self, name).copy_(torch.as_tensor(tab[name]))
        self.a.fill_(self.zero_lag_init)
        self.beta.zero_()

    def _controls(self, u: torch.Tensor, K: int, valid: torch.Tensor | None):
        """u [..., D] -> v [..., K, P], write/read/clock [..., K, M] in the scan dtype (at least fp32); the
        projection stays in its dtype (each consumer upcasts as it reads) and Eq. 23 is one product
        ``v0 ((1 - beta) + beta / rms(v0))``."""
        P, M = self.P, self.M
        h = linear(self.in_proj, u, rows=K * (P + 3 * M)).unflatten(-1, (K, P + 3 * M))   # [..., K, P+3M]
        dtype = torch.promote_types(self.theta.dtype, torch.float32)   # the scan never runs below fp32
        v0 = h[..., :P]
        pre = h[..., P:].unflatten(-1, (3, M)) + prefix(self.gate_bias, K).to(dtype)  # [..., K, 3, M], promoted
        beta = prefix(self.beta, K)[:, None].to(dtype)
        sq = torch.linalg.vector_norm(v0, dim=-1, keepdim=True, dtype=dtype).square()
        v = v0 * ((1 - beta) + beta * torch.rsqrt(sq / P + self.blend_eps))     # Eq. 23
        write, read = (2 * torch.sigmoid(pre[..., :2, :])).unbind(-2)
        clock = F.softplus(pre[..., 2, :])
        if valid is not None:
            write = write * valid[..., None, None].to(dtype)
        return v.to(dtype), write, read, clock

    def _modal(self, K: int, dtype: torch.dtype | None = None) -> ModalTables:
        """The modal tables rho, theta, kc, ks, a [K, M] of the first K channels in ``dtype`` (default: at least
        fp32; bf16 would round rho ~ 1 - 1e-4 to 1). rho = exp(-softplus(rho_raw)) (C.3)."""
        dt = dtype or torch.promote_types(self.theta.dtype, torch.float32)
        rho = torch.exp(-F.softplus(prefix(self.rho_raw, K).to(dt)))
        return ModalTables(rho, *(prefix(t, K).to(dt) for t in (self.theta, self.kc, self.ks, self.a)))

    def _readout(self, z: torch.Tensor, K: int, channel_scale: torch.Tensor | None = None) -> torch.Tensor:
        """z [..., K, P] -> y [..., D] = K^{-1/2} W^out z (first K*P columns of W^out). ``channel_scale`` [B, K P]:
        rows at narrower tiers (``elastic/slicing.py``), z [B, T, K, P] scaled per row before the readout."""
        zf = z.flatten(-2)
        if channel_scale is not None:
            zf = zf * channel_scale[:, None, :].to(zf.dtype)
        return linear(self.out_proj, zf, cols=K * self.P) * (1.0 / math.sqrt(K))

    def channel_energy(self, z: torch.Tensor, K: int) -> torch.Tensor:
        """Mean output energy of each channel, ``E_k = mean_t ||W_k^out z_k(t)||^2`` [K] (float64), for the scan
        output ``z [..., K, P]``; ``W_k^out`` [D, P] is channel k's column block of ``out_proj.weight``. Computed
        through the Gram matrices ``W_k^T W_k`` [K, P, P], never materialising the [..., K, D] contributions
        (ESSH App. L.3 output energy; the ``K^{-1/2}`` of the readout is not included)."""
        dt = torch.promote_types(self.out_proj.weight.dtype, torch.float32)
        w = linear_weight(self.out_proj, cols=K * self.P).to(dt).unflatten(1, (K, self.P))   # [D, K, P]
        gram = torch.einsum("dkp,dkq->kpq", w, w)                                          # [K, P, P]
        zf = z.to(dt).reshape(-1, K, self.P)                                               # [N, K, P]
        return torch.einsum("nkp,kpq,nkq->k", zf, gram, zf).double() / max(zf.shape[0], 1)

    def forward(self, u: torch.Tensor, K: int | None = None, valid: torch.Tensor | None = None,
                output_final_state: bool = False, backend: str = "auto", channel_scale: torch.Tensor | None = None):
        """u [B,T,D] -> y [B,T,D] (and the final state [B,K,M,2,P] when ``output_final_state``); ``channel_scale``
        [B, K P]: each row's tier (``_readout``)."""
        K = self.K if K is None else K
        v, write, read, clock = self._controls(u, K, valid)
        # gates in (0, 2), clock = softplus >= 0 and rho = exp(-softplus) in [0, 1] by construction: no range check
        z, state = scan(v, write, read, clock, self._modal(K), output_final_state=output_final_state, backend=backend,
                        check_values=False)
        y = self._readout(z, K, channel_scale)
        return (y, state) if output_final_state else y

    def mix(self, u: torch.Tensor, tier, positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
            state: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
        """The block's call (same for every mixer): u [B,T,D] at ``tier`` -> y [B,T,D]; the final mode state is
        written into ``state`` (this layer's cache slice) when given; ``positions`` is unused."""
        K, scale = tier_width(tier, self.K), getattr(tier, "channel_scale", None)      # RowTiers: per-row tiers
        if state is None:
            return self(u, K, valid, backend=backend, channel_scale=scale)
        y, final = self(u, K, valid, output_final_state=True, backend=backend, channel_scale=scale)
        state.copy_(final)
        return y

    def init_state(self, batch: int, tier=None, *, state_dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, **_: object) -> torch.Tensor:
        """This layer's slice of a decode cache: zeroed mode states [B, K_T, M, 2, P] in ``state_dtype``
        (2 K_T m P entries per sequence, ESSH C.5); other layers' arguments are ignored."""
        K = tier_width(tier, self.K)
        return torch.zeros(batch, K, self.M, 2, self.P, dtype=state_dtype, device=device or self.theta.device)

    def step(self, x: torch.Tensor, state: torch.Tensor, tier=None) -> torch.Tensor:
        """Reference single-token step (float64-capable): x [B,D], state [B,K,M,2,P] updated in place ->
        y [B,D]. Eq. 23 blend, C.2 gates and the Eq. 5 / Eq. 24 step of ``ops.spectral_scan_step``."""
        K = tier_width(tier, self.K)
        v, write, read, clock = self._controls(x, K, None)
        z, _ = spectral_scan_step(v, write, read, clock, self._modal(K), state)
        return self._readout(z, K)

    @torch.no_grad()
    def decode_plan(self, tier=None, state_dtype: torch.dtype = torch.float32,
                    split_copy: bool = False) -> SpectralPlan:
        """The fused step's plan at ``tier``: prefix views of ``in_proj.weight`` [K(P+3M), D] and ``out_proj.weight``
        [D, K P], the modal constants of C.3 / Eq. 24 (float64, cast to ``state_dtype``) and with ``split_copy``
        an in-by-out copy [K P, D] of the output weight."""
        K, P, M, d = tier_width(tier, self.K), self.P, self.M, torch.float64
        w_in = linear_weight(self.in_proj, rows=K * (P + 3 * M))
        w_out = linear_weight(self.out_proj, cols=K * P)
        consts = ModalConstants.pack(prefix(self.gate_bias, K).to(d), self._modal(K, d),
                                     prefix(self.beta, K).to(d), P, self.blend_eps, state_dtype)
        return SpectralPlan(w_in, w_out, consts, in_by_out_copy(w_out, split_copy))
