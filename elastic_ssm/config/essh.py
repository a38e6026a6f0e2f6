"""``ESSHConfig``: the ESSH hybrid (ESSH paper Sec. 4, Table 7) and its tiers and exact counts.

Spectral mixers + sliding-window attention + SwiGLU; tiers by the two-rate map of Eq. 7 (``elastic/tiers.py``),
parameters by Eq. 25 (Table 4), state by C.5 (Table 53). Presets: Table 7 ("370m", "1.5b"), "40m" (issue 16's
byte-level replication), "tiny" (tests), "small" (quickstart); ``<name>-mixer`` drops attention (Tables 21-23)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN
from fractions import Fraction
from typing import Annotated, Any, ClassVar

from annotated_types import Interval

from .base import ConfigError, Distinct, HeadDim, Ladder, NonNeg, NonNegF, Pos, PosInt, TierNames, TokenId, opt
from .model import FractionTierConfig, Tier, scaled_power

__all__ = ["ESSHConfig", "ESSH_PRESETS", "ESSH_TIER_XI"]

#: Budget fractions xi_T of the ten ESSH deployment tiers (Appendix D.1, Table 6).
ESSH_TIER_XI = tuple(n / 32 for n in (2, 4, 7, 10, 13, 17, 20, 24, 28, 32))

Open01 = Annotated[float, Interval(gt=0, lt=1)]   # (0, 1)


@dataclass(kw_only=True)
class ESSHConfig(FractionTierConfig):
    """ESSH hybrid (ESSH paper Sec. 4, Table 7): spectral mixers + sliding-window attention + SwiGLU."""

    arch: ClassVar[str] = "essh"
    elastic_recipes: ClassVar[tuple[str, ...]] = ("capacity_mixed", "refine")

    vocab_size: PosInt = opt(50304, "vocabulary size V (tied embedding)")
    d_model: PosInt = opt(896, "residual width d")
    n_layers: PosInt = opt(22, "number of blocks (spectral + SWA)")
    d_ff: PosInt = opt(4608, "full SwiGLU width d_ff")
    n_channels: PosInt = opt(32, "full spectral-channel count K-bar")
    n_modes: PosInt = opt(8, "damped-rotation modes m per channel")
    channel_width: NonNeg = opt(0, "value width P per channel; 0 means d / n_channels (standalone exports set it)")
    swa_layers: Annotated[tuple[NonNeg, ...], Distinct] = opt((12, 17, 21), "zero-based indices of the "
                                                              "sliding-window-attention blocks")
    window: PosInt = opt(2048, "sliding-window length w (tokens attended, including the current one)")
    head_dim: HeadDim = opt(64, "attention head dimension (heads = d / head_dim)")
    rope_base: Pos = opt(10000.0, "RoPE base frequency (paper silent; 10000 as in Su et al.)")
    filter_length: PosInt = opt(2048, "Hankel length L of the filters the modal tables are fitted to (C.1)")
    tier_xi: Ladder = opt(ESSH_TIER_XI, "budget fractions xi_T of the deployment tiers (D.1)")
    tier_names: TierNames = opt((), "names of the tier_xi tiers; empty: T1..Tn (a standalone export keeps its "
                                      "source tier's name, e.g. [T4])")
    channel_exponent: Pos = opt(0.5, "two-rate map: K_T = max(1, round(K xi^e)) (Eq. 7)")
    ffn_exponent: Pos = opt(0.8, "two-rate map: n_ff = align * max(1, floor(d_ff xi^e / align)) (Eq. 7)")
    ffn_align: PosInt = opt(64, "FFN width alignment of the two-rate map (Eq. 7: 64)")
    tie_embeddings: bool = opt(True, "tie the LM head to the token embedding")
    norm_eps: Pos = opt(1e-6, "RMSNorm epsilon")
    blend_eps: Pos = opt(1e-6, "epsilon_norm of the channel-local value blend (Eq. 23)")
    clock_bias_init: float = opt(-3.0, "clock bias initialisation (C.2: softplus(-3) ~ 0.0486)")
    zero_lag_init: float = opt(0.5, "zero-lag coefficient a initialisation (C.3)")
    pole_clip: Open01 = opt(1.0 - 1e-4, "matrix-pencil pole-magnitude clip (DESIGN: 1 - 1e-4)")
    init_std: NonNegF = opt(0.02, "std of normal initialisation for projections and embeddings")
    pad_token_id: TokenId = opt(-1, "padding token id for batched generation (-1: none)")
    eos_token_id: TokenId = opt(-1, "end-of-sequence token id (-1: none)")

    def validate(self) -> None:
        if self.channel_width == 0 and self.d_model % self.n_channels:
            raise ConfigError(f"ESSHConfig.d_model={self.d_model} must be divisible by n_channels={self.n_channels}"
                              " (value width P = d / K-bar)")
        super().validate()
        if any(i >= self.n_layers for i in self.swa_layers):
            raise ConfigError(f"ESSHConfig.swa_layers={self.swa_layers}: indices must be in [0, {self.n_layers})")
        if self.n_modes > self.filter_length // 4:
            raise ConfigError("ESSHConfig.n_modes must be <= filter_length / 4 (matrix-pencil rank)")

    @property
    def value_width(self) -> int:
        """P = d / K-bar, the per-channel value width (or the explicit ``channel_width``)."""
        return self.channel_width or self.d_model // self.n_channels

    @property
    def layout(self) -> str:
        """Hybrid layout as a pattern string: 'S' spectral block, 'A' sliding-window attention block."""
        return "".join("A" if i in self.swa_layers else "S" for i in range(self.n_layers))

    @property
    def n_spectral_layers(self) -> int:
        return self.n_layers - len(self.swa_layers)

    # ---- tiers and exact costs (Eq. 7, Eq. 25, C.5) --------------------------------------------------------
    def channels_for(self, xi: float | Fraction) -> int:
        """Retained spectral channels ``K_T = max(1, round(K-bar xi^e))`` (Eq. 7, ``e = channel_exponent``), rounded
        half to even from the exact value (no budget lands on a .5 tie: DESIGN.md)."""
        v = scaled_power(self.n_channels, xi, self.channel_exponent)
        return max(1, int(v.to_integral_value(rounding=ROUND_HALF_EVEN)))

    def fraction_tier(self, name: str, index: int, xi: float) -> Tier:
        K, n_ff = self.channels_for(xi), self.ffn_width_for(xi)
        return Tier(name, index, float(xi), K, n_ff, self.count_parameters(K, n_ff)["total"])

    def count_parameters(self, K: int, n_ff: int) -> dict[str, int]:
        """Parameters at ``K`` channels and ``n_ff`` FFN units by component (Eq. 25; Table 4 rules: tied
        embedding once, two RMSNorm vectors per block and one final norm, one bias per mode on the
        write/read/clock rows, nothing else biased)."""
        d, m, P, N = self.d_model, self.n_modes, self.value_width, self.n_layers
        out = {
            "embedding": self.vocab_size * d,
            "head": 0 if self.tie_embeddings else self.vocab_size * d,
            "norms": 2 * d * N + d,  # two RMSNorm weights per block + the final norm
            "attention": 4 * d * d * len(self.swa_layers),  # q, k, v, o without biases
            # per retained channel: value in/out 2dP, write/read/clock (md + m) each,
            # rho/theta/kc/ks/a (5m), blend beta (1)  ->  2dP + 3md + 8m + 1
            "spectral": self.n_spectral_layers * K * (2 * d * P + 3 * m * d + 8 * m + 1),
            "ffn": 3 * d * n_ff * N,  # SwiGLU gate/up/down in every block
        }
        return {**out, "total": sum(out.values())}

    def tier_parameters(self, tier: Tier) -> dict[str, int]:
        return self.count_parameters(tier.K, tier.n_ff)

    def tier_state(self, tier: Tier, decode: str = "exact", n_modes: int = 8, context: int = 2048) -> tuple[int, int]:
        """``2 (N - |A|) K_T m P`` recurrent entries (C.5) and a full ``window`` ring of K and V per SWA
        layer (``decode``, ``n_modes``, ``context`` do not apply)."""
        rec = 2 * self.n_spectral_layers * tier.K * self.n_modes * self.value_width
        return rec, len(self.swa_layers) * 2 * self.window * self.d_model

    def tier_flops(self, tier: Tier, context: int = 2048) -> dict[str, int]:
        """Summed over blocks: ``projection`` 2 (2 d K P + 3 d K m) per spectral block; ``ffn`` 2 * 3 d n_ff per
        block; ``attention`` 2 (4 d^2 + 2 d min(context, window)) per SWA block; ``scan`` 2 K (7 m P + 3 P) per
        spectral block (Eq. 9 step 7mP, zero-lag Eq. 24 P, blend Eq. 23 2P); ``head`` 2 d V (C.5)."""
        d, K, m, P = self.d_model, tier.K, self.n_modes, self.value_width
        S, A = self.n_spectral_layers, len(self.swa_layers)
        out = {
            "projection": 2 * S * (2 * d * K * P + 3 * d * K * m),
            "ffn": 2 * self.n_layers * 3 * d * tier.n_ff,
            "attention": 2 * A * (4 * d * d + 2 * d * min(context, self.window)),
            "scan": 2 * S * K * (7 * m * P + 3 * P),
            "head": 2 * d * self.vocab_size,
        }
        return {**out, "total": sum(out.values())}

    def standalone_config(self, tier: Tier) -> ESSHConfig:
        return self.replace(n_channels=tier.K, channel_width=self.value_width, d_ff=tier.n_ff, tier_xi=(1.0,),
                            tier_names=self.standalone_names(tier))

    def default_recipe(self) -> str:
        return "capacity_mixed" if len(self.tier_xi) > 1 else "dense"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ESSHConfig:
        """A named shape; ``<name>-mixer`` is the mixer-only variant (no attention blocks, Tables 21-23)."""
        base, mixer_only = (name[:-6], True) if name.endswith("-mixer") else (name, False)
        if base not in ESSH_PRESETS:
            raise ConfigError(f"unknown ESSH preset {name!r}; choose one of {sorted(ESSH_PRESETS)}, or one of "
                              "them with '-mixer' for the mixer-only variant")
        return cls(**{**ESSH_PRESETS[base], **({"swa_layers": ()} if mixer_only else {}), **overrides})


ESSH_PRESETS: dict[str, dict[str, Any]] = {
    # Table 7, 370M column.
    "370m": dict(vocab_size=50304, d_model=896, n_layers=22, d_ff=4608, swa_layers=(12, 17, 21)),
    # Table 7, 1.5B column.
    "1.5b": dict(vocab_size=128256, d_model=2048, n_layers=28, d_ff=5632, swa_layers=(15, 22, 27)),
    # Byte-level replication (issue 16, configs/replication/): window = the 1024-byte training length.
    "40m": dict(vocab_size=260, d_model=512, n_layers=10, d_ff=2048, n_channels=32, n_modes=8, swa_layers=(4, 9),
                window=1024, head_dim=64, filter_length=1024),
    # CPU presets (byte vocabulary 256 + 4 specials): "tiny" for tests, "small" for the quickstart.
    "tiny": dict(vocab_size=260, d_model=64, n_layers=3, d_ff=192, n_channels=8, n_modes=4,
                 swa_layers=(1,), window=16, head_dim=16, filter_length=256, ffn_align=16),
    "small": dict(vocab_size=260, d_model=192, n_layers=4, d_ff=512, n_channels=16, n_modes=8,
                  swa_layers=(2,), window=128, head_dim=32, filter_length=1024, ffn_align=32),
}
