"""``TransformerConfig`` / ``MatFormerConfig``: the ESSH paper's baselines (Appendix E.6, Tables 8, 9, 54).
Transformer++ with ESSH's unit-ordered SwiGLU, so nested FFN tiers ``n_ff(xi) = align * max(1, floor(d_ff *
xi ** ffn_exponent / align))`` (one tier by default); MatFormer: the ten ESSH fractions as tiers, four trained
granularities (N.1; at 370m Table 39's counts, T1 130.9M ... T10 365.6M). Presets match ESSH's within 2% (Table 8)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from .base import ConfigError, HeadDim, Ladder, NonNegF, Pos, PosInt, TierNames, TokenId, opt
from .essh import ESSH_TIER_XI
from .model import FractionTierConfig, Tier

__all__ = ["TransformerConfig", "MatFormerConfig", "TRANSFORMER_PRESETS", "MATFORMER_GRANULARITIES"]

#: MatFormer's trained FFN granularities in the ESSH comparison (Appendix N.1): 1/8, 1/4, 1/2 and full width.
MATFORMER_GRANULARITIES = (0.125, 0.25, 0.5, 1.0)

TRANSFORMER_PRESETS: dict[str, dict[str, Any]] = {
    # CPU presets: ESSH "tiny" / "small" shapes, d_ff matched to their full counts.
    "tiny": dict(vocab_size=260, d_model=64, n_layers=3, d_ff=184, head_dim=16, ffn_align=8),
    "small": dict(vocab_size=260, d_model=192, n_layers=4, d_ff=512, head_dim=32, ffn_align=32),
    # ESSH "40m" (issue 16's replication): same depth, width, vocabulary.
    "40m": dict(vocab_size=260, d_model=512, n_layers=10, d_ff=1984, head_dim=64, ffn_align=64),
    # Table 9: Transformer++ / MatFormer of the 370M comparison, 365.6M (ESSH 370.9M, -1.42%).
    "370m": dict(vocab_size=50304, d_model=896, n_layers=22, d_ff=4224, head_dim=64, ffn_align=64),
    # Table 54: Transformer++ of the 1.53B systems comparison, 1536.3M (ESSH 1531.1M, +0.34%).
    "1.5b": dict(vocab_size=128256, d_model=2048, n_layers=28, d_ff=4672, head_dim=64, ffn_align=64),
}


@dataclass(kw_only=True)
class TransformerConfig(FractionTierConfig):
    """Transformer++ shape (ESSH paper E.6, Tables 9 and 54), with nested-FFN tiers (one tier by default)."""

    arch: ClassVar[str] = "transformer"

    vocab_size: PosInt = opt(50304, "vocabulary size V (tied embedding)")
    d_model: PosInt = opt(896, "residual width d")
    n_layers: PosInt = opt(22, "number of attention + SwiGLU blocks")
    d_ff: PosInt = opt(4224, "SwiGLU width (Table 9: 4224 at 370M; Table 54: 4672 at 1.5B)")
    head_dim: HeadDim = opt(64, "attention head dimension (heads = d / head_dim)")
    rope_base: Pos = opt(10000.0, "RoPE base frequency")
    norm_eps: Pos = opt(1e-6, "RMSNorm epsilon")
    tie_embeddings: bool = opt(True, "tie the LM head to the token embedding")
    init_std: NonNegF = opt(0.02, "std of the normal initialisation")
    tier_xi: Ladder = opt((1.0,), "budget fractions of the nested-FFN tiers ((1.0,): a plain "
                                     "Transformer++ with one tier; MatFormer: the ten ESSH fractions)")
    tier_names: TierNames = opt((), "names of the tier_xi tiers; empty: T1..Tn (a standalone export keeps its "
                                      "source tier's name, e.g. [T4])")
    ffn_exponent: Pos = opt(1.0, "nested FFN width n_ff = align floor(d_ff xi^e / align) (Table 39: e = 1)")
    ffn_align: PosInt = opt(64, "FFN width alignment of the nested tiers (Table 39: 64)")
    eos_token_id: TokenId = opt(-1, "end-of-sequence token id (-1: none)")

    def count_parameters(self, n_ff: int) -> dict[str, int]:
        """Parameters at ``n_ff`` FFN units by component (Table 4 rules: ``V d + N (4 d^2 + 3 d n_ff + 2 d) + d``)."""
        d, N = self.d_model, self.n_layers
        out = {"embedding": self.vocab_size * d, "head": 0 if self.tie_embeddings else self.vocab_size * d,
               "norms": 2 * d * N + d, "attention": 4 * d * d * N, "ffn": 3 * d * n_ff * N}
        return {**out, "total": sum(out.values())}

    # ---- nested FFN tiers (K = 0) ------------------------------------------------------------------------
    def ffn_width_for(self, xi: float | Fraction) -> int:
        """The nested map ``align max(1, floor(d_ff xi^e / align))``; the full tier keeps every unit."""
        return self.d_ff if xi == 1 else min(self.d_ff, super().ffn_width_for(xi))

    def fraction_tier(self, name: str, index: int, xi: float) -> Tier:
        n_ff = self.ffn_width_for(xi)
        return Tier(name, index, float(xi), 0, n_ff, self.count_parameters(n_ff)["total"])

    def tier_parameters(self, tier: Tier) -> dict[str, int]:
        return self.count_parameters(tier.n_ff)

    def tier_state(self, tier: Tier, decode: str = "exact", n_modes: int = 8, context: int = 2048) -> tuple[int, int]:
        """Full attention: K and V of every layer for ``context`` tokens, no recurrent state."""
        return 0, self.n_layers * 2 * context * self.d_model

    def tier_flops(self, tier: Tier, context: int = 2048) -> dict[str, int]:
        """Projections 2 N 4 d^2, attention scores/values 2 N 2 d context, SwiGLU 2 N 3 d n_ff, head 2 d V."""
        d, N = self.d_model, self.n_layers
        out = {"projection": 2 * N * 4 * d * d, "attention": 2 * N * 2 * d * context,
               "ffn": 2 * N * 3 * d * tier.n_ff, "head": 2 * d * self.vocab_size}
        return {**out, "total": sum(out.values())}

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        if name not in TRANSFORMER_PRESETS:
            raise ConfigError(f"unknown {cls.arch} preset {name!r}; choose one of {sorted(TRANSFORMER_PRESETS)}")
        return cls(**{**TRANSFORMER_PRESETS[name], **overrides})


@dataclass(kw_only=True)
class MatFormerConfig(TransformerConfig):
    """MatFormer (Devvrit et al., 2024) as the ESSH paper trains it (N.1, Table 9): a Transformer++ whose
    FFNs nest; every micro-batch trains one of ``granularities`` (uniform draw), no distillation."""

    arch: ClassVar[str] = "matformer"

    tier_xi: Ladder = opt(ESSH_TIER_XI, "deployment fractions of the exported tiers (Table 39: the "
                                     "ten ESSH fractions; T1 lies below the smallest trained granularity)")
    granularities: Ladder = opt(MATFORMER_GRANULARITIES, "FFN width fractions trained, one drawn "
                                           "uniformly per micro-batch (N.1: 1/8, 1/4, 1/2, full)")

    def default_recipe(self) -> str:
        return "nested_ffn" if len(self.granularities) > 1 else "dense"

    def standalone_config(self, tier: Tier) -> MatFormerConfig:
        """One tier and one (full) granularity of ``n_ff`` units."""
        return self.replace(d_ff=tier.n_ff, tier_xi=(1.0,), granularities=(1.0,),
                            tier_names=self.standalone_names(tier))
