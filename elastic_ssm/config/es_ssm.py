"""``ESSSMConfig``: ES-SSM (LTI spectral sublayer, ES-SSM paper Sec. 4) and its budgets' exact counts: one tier
per runtime budget ``K`` in ``budgets``; the FFN is not elastic (``n_ff = d * ffn_mult``, ``xi = K / K-bar``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Len

from .base import ConfigError, Frac01, NonNeg, NonNegF, Pos, PosInt, Rising, TokenId, opt
from .model import ModelConfig, Tier

__all__ = ["ESSSMConfig", "ESSSM_PRESETS", "ESSSM_BUDGETS"]

#: Default ES-SSM runtime-budget set (ES-SSM paper, Sec. 4.2).
ESSSM_BUDGETS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)

Budgets = Annotated[tuple[PosInt, ...], Len(1), Rising]


@dataclass(kw_only=True)
class ESSSMConfig(ModelConfig):
    """ES-SSM (LTI spectral sublayer, ES-SSM paper Sec. 4): byte-level LM or sequence classifier."""

    arch: ClassVar[str] = "es_ssm"
    elastic_recipes: ClassVar[tuple[str, ...]] = ("budget_dropout",)
    length_field: ClassVar[str] = "seq_len"      # the filter length L bounds every input

    vocab_size: PosInt = opt(260, "input vocabulary (bytes 0-255 plus pad/bos/eos/sep specials)")
    d_model: PosInt = opt(256, "residual width d")
    n_layers: PosInt = opt(4, "number of ES-SSM blocks")
    n_channels: PosInt = opt(32, "full spectral budget K-bar (Hankel channels)")
    seq_len: PosInt = opt(1024, "filter length L: the longest sequence the model accepts")
    budgets: Budgets = opt(ESSSM_BUDGETS, "runtime-budget set (channel counts) for training/export")
    gate_hidden_ratio: float = opt(0.5, "gate-MLP hidden width d_g as a fraction of d (paper: 1/2)")
    gate_bias_init: float = opt(-2.0, "initial gate-logit bias b_g2 (paper: -2, sigmoid ~ 0.12)")
    ffn_mult: PosInt = opt(4, "GELU FFN widening factor")
    drop_path: Frac01 = opt(0.0, "stochastic-depth rate on both residual branches")
    dropout: Frac01 = opt(0.0, "dropout inside the FFN")
    norm_eps: Pos = opt(1e-5, "LayerNorm epsilon")
    task: Literal["lm", "classify"] = opt("lm", "'lm' (next-token) or 'classify' (mean-pooled sequence classification)")
    num_classes: NonNeg = opt(0, "classes for task='classify'")
    tie_embeddings: bool = opt(True, "tie the LM head to the input embedding")
    init_std: NonNegF = opt(0.02, "std of normal initialisation for projections and embeddings")
    eos_token_id: TokenId = opt(-1, "end-of-sequence token id that stops generation (-1: none)")

    def validate(self) -> None:
        super().validate()
        if self.task == "classify" and self.num_classes < 2:
            raise ConfigError("ESSSMConfig.num_classes must be >= 2 when task='classify'")
        if self.budgets[-1] != self.n_channels:       # increasing (declared), so every K lies in [1, n_channels]
            raise ConfigError(f"ESSSMConfig.budgets must be channel counts in [1, n_channels={self.n_channels}] "
                              f"ending with the full budget n_channels, got {self.budgets}")
        if self.d_model * self.gate_hidden_ratio < 1:
            raise ConfigError("ESSSMConfig.gate_hidden_ratio * d_model must be >= 1")

    @property
    def gate_hidden(self) -> int:
        return max(1, int(round(self.d_model * self.gate_hidden_ratio)))

    # ---- tiers and exact counts (Sec. 4) ------------------------------------------------------------------
    def budget_tier(self, K: int) -> Tier:
        """The tier of runtime budget ``K`` (index 0 when ``K`` is not in ``budgets``); the FFN is not elastic."""
        index = self.budgets.index(K) + 1 if K in self.budgets else 0
        return Tier(f"K{K}", index, K / self.n_channels, K, self.d_model * self.ffn_mult,
                    self.count_parameters(K)["total"])

    def tier_table(self) -> list[Tier]:
        return [self.budget_tier(K) for K in self.budgets]

    def parse_tier(self, spec: Any) -> Tier | None:
        """An int ``K`` in ``[1, K-bar]`` or ``"K<k>"``; a ``K`` outside ``budgets`` is allowed."""
        if isinstance(spec, str):
            m = re.fullmatch(r"[kK](\d+)", spec.strip())
            K = int(m.group(1)) if m else None
        else:
            K = spec if isinstance(spec, int) and not isinstance(spec, bool) else None
        return self.budget_tier(K) if K is not None and 1 <= K <= self.n_channels else None

    def tier_hint(self) -> str:
        K = self.n_channels           # the example is a valid budget of this model (the largest)
        return (f"give a budget K in [1, {K}] ({K} or 'K{K}'; trained budgets: "
                f"{[t.name for t in self.tier_table()]}) or the full model (None in Python, 'full' on the command "
                "line)")

    def count_parameters(self, K: int) -> dict[str, int]:
        """Parameters at budget ``K`` by component: embedding, head, norms, gate, spectral, ffn."""
        d, dg, N = self.d_model, self.gate_hidden, self.n_layers
        n_ff = d * self.ffn_mult
        lm = self.task == "lm"
        out = {
            "embedding": self.vocab_size * d,
            "head": (0 if self.tie_embeddings else self.vocab_size * d) if lm
            else d * self.num_classes + self.num_classes,
            "norms": N * 4 * d + 2 * d,  # LN1, LN2 (weight + bias) per block + final LayerNorm
            "gate": N * (dg * d + dg + K * dg + K),  # W_g1, b_g1, retained rows of W_g2, b_g2
            "spectral": N * K * d * d,  # M_k, dense d x d per retained channel, no bias
            "ffn": N * (2 * d * n_ff + n_ff + d),  # d -> n_ff -> d with biases
        }
        return {**out, "total": sum(out.values())}

    def tier_parameters(self, tier: Tier) -> dict[str, int]:
        return self.count_parameters(tier.K)

    def tier_state(self, tier: Tier, decode: str = "exact", n_modes: int = 8, context: int = 2048) -> tuple[int, int]:
        """The LTI sublayer has no finite recurrent realisation: exact decoding keeps the last ``L - 1``
        normalised inputs of every block (``N (L - 1) d`` entries, whatever K); the modal decoder keeps
        ``2 N K m d`` entries (m = ``n_modes`` per retained channel). No KV cache."""
        if decode == "exact":
            return self.n_layers * (self.seq_len - 1) * self.d_model, 0
        if decode == "modal":
            return 2 * self.n_layers * tier.K * n_modes * self.d_model, 0
        raise ValueError(f"unknown decode mode {decode!r}; use 'exact' or 'modal'")

    def tier_flops(self, tier: Tier, context: int = 2048) -> dict[str, int]:
        """Summed over blocks, ``context`` = sequence length T: ``projection`` 2 (K d^2 + d d_g + d_g K);
        ``ffn`` 2 * 2 d n_ff; ``scan`` the FFT convolution at length 2T per token, ``5 d (K + 1) log2(2T) +
        6 K d`` (rounded); ``attention`` 0; ``head`` 2 d V (LM) or 2 d C / T (one pooled head per sequence)."""
        d, K, N, dg = self.d_model, tier.K, self.n_layers, self.gate_hidden
        fft = 5 * d * (K + 1) * math.log2(2 * context) + 6 * K * d
        head = 2 * d * self.vocab_size if self.task == "lm" else 2 * d * self.num_classes / context
        out = {
            "projection": 2 * N * (K * d * d + d * dg + dg * K),
            "ffn": 2 * N * 2 * d * tier.n_ff,
            "attention": 0,
            "scan": round(N * fft),
            "head": round(head),
        }
        return {**out, "total": sum(out.values())}

    def state_columns(self, tier: Tier, state_bytes: Any, batch: int,
                      n_modes: tuple[int, ...]) -> list[tuple[str, str]]:
        """The fp32 decode state of the exact ring buffer and of the modal decoder at each m, in MB."""
        cols = [("exact MB", state_bytes(self, tier, batch=batch, decode="exact"))]
        cols += [(f"modal m={m} MB", state_bytes(self, tier, batch=batch, decode="modal", n_modes=m)) for m in n_modes]
        return [(h, f"{sb['total'] / 1e6:.3f}") for h, sb in cols]

    def standalone_config(self, tier: Tier) -> ESSSMConfig:
        """Budget K: ``n_channels=K``, budgets ``{b < K} + (K,)`` (budget dropout of the export), all else equal."""
        return self.replace(n_channels=tier.K, budgets=tuple(b for b in self.budgets if b < tier.K) + (tier.K,))

    def specialist_config(self, tier: Tier) -> ESSSMConfig:
        """A specialist trains its one budget only."""
        return self.replace(n_channels=tier.K, budgets=(tier.K,))

    def default_recipe(self) -> str:
        return "budget_dropout" if len(self.budgets) > 1 else "dense"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ESSSMConfig:
        """A named configuration (``ESSSM_PRESETS``) with ``overrides``."""
        if name not in ESSSM_PRESETS:
            raise ConfigError(f"unknown ES-SSM preset {name!r}; choose one of {sorted(ESSSM_PRESETS)}")
        return cls(**{**ESSSM_PRESETS[name], **overrides})


#: ES-SSM presets: "tiny" (tests), "small" (CPU), and byte LMs of Sec. 4-5 with DropPath 0.1 (our choice; the
#: paper gives no rate). "1.3b" (App. A) has no stated shape: d = 1152 and 24 blocks are INFERRED from its count.
ESSSM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, n_layers=2, n_channels=8, seq_len=128, budgets=(2, 4, 8)),
    "small": dict(d_model=128, n_layers=4, n_channels=24, seq_len=512, budgets=(2, 3, 4, 5, 6, 8, 12, 16, 24)),
    "byte-base": dict(d_model=512, n_layers=8, n_channels=32, seq_len=2048, drop_path=0.1),
    "1.3b": dict(d_model=1152, n_layers=24, n_channels=32, seq_len=2048, drop_path=0.1),
}
