"""Capacity tiers: the two-rate map, tier tables and exact per-tier costs computed from a config.

ESSH (``ESSHConfig``): a tier ``T`` keeps spectral channels ``1..K_T`` and FFN units ``1..n_ff,T``
given by the two-rate capacity map (ESSH paper Sec. 4.2, Eq. 7; Appendix D.1, Table 6)::

    K_T   = max(1, round(K-bar * xi_T ** 0.5))
    n_ff  = align * max(1, floor(d_ff * xi_T ** 0.8 / align))       (align = 64 in the paper)

Parameter counts follow Eq. 25 of Appendix C.5 with the counting rules that reproduce Table 4 exactly
(tied embedding once, two RMSNorm vectors per block and one final norm, bias-free value/output, attention
and SwiGLU projections; write/read/clock rows carry one bias per mode). Persistent state follows C.5 and
Table 53 (``2 (N - |A|) K_T m P`` recurrent entries; a ``window x d`` K and V cache per SWA layer).

ES-SSM (``ESSSMConfig``): one tier per runtime budget ``K`` in ``cfg.budgets`` (ES-SSM paper Sec. 4);
the FFN is not elastic, so ``n_ff = d * ffn_mult`` and ``xi = K / K-bar``.

Transformer++ / MatFormer (``TransformerConfig``, ``baseline_config.py``): nested FFN tiers only, ``K = 0``;
``n_ff`` by the one-rate map ``align max(1, floor(d_ff xi^e / align))`` (``e = 1``: Table 39), the full tier
keeping ``d_ff``; counts by the same rules as ESSH (Table 4), KV state of full attention at ``context``.

All counts are computed from the config alone; ``docs/tiers.md`` states every rule in prose.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Decimal, localcontext
from fractions import Fraction
from typing import Any

from ..baseline_config import TransformerConfig
from ..config import ESSHConfig, ESSSMConfig

__all__ = [
    "Tier",
    "tier_table",
    "resolve_tier",
    "capacity_tier",
    "channels_for",
    "ffn_width_for",
    "num_parameters",
    "parameter_breakdown",
    "state_bytes",
    "flops_per_token",
    "format_tier_table",
]

AnyConfig = ESSHConfig | ESSSMConfig | TransformerConfig
#: configs whose tiers are named T1..Tn over ``tier_xi`` and accept any capacity fraction
_FRACTION_TIERS = (ESSHConfig, TransformerConfig)


@dataclass(frozen=True)
class Tier:
    """One deployment tier.

    ``name`` is ``"T1".."Tn"`` for ESSH and ``"K<k>"`` for ES-SSM; ``index`` is the 1-based position in
    ``tier_table(cfg)`` (0 for an ES-SSM budget that is not in ``cfg.budgets``); ``xi`` the budget
    variable of Eq. 7 (ES-SSM: ``K / K-bar``); ``K`` retained spectral channels; ``n_ff`` retained FFN
    width; ``params`` the exact parameter count of the standalone export.
    """

    name: str
    index: int
    xi: float
    K: int
    n_ff: int
    params: int


# ---- Eq. 7: the two-rate capacity map ------------------------------------------------------------
def _dec(x: float | int | Fraction) -> Decimal:
    """The exact decimal a number denotes (a float by its shortest repr, so 0.8 means 4/5)."""
    if isinstance(x, Fraction):
        return Decimal(x.numerator) / Decimal(x.denominator)
    return Decimal(repr(float(x))) if isinstance(x, float) else Decimal(int(x))


def _scaled_power(total: int, xi: float | Fraction, exponent: float) -> Decimal:
    """``total * xi ** exponent`` to 50 significant digits (correctly rounded ``Decimal`` power)."""
    xi_d = _dec(xi)
    if not 0 < xi_d <= 1:
        raise ValueError(f"budget variable xi must lie in (0, 1], got {xi!r}")
    with localcontext() as ctx:
        ctx.prec = 50
        return Decimal(total) * xi_d ** _dec(exponent)


def _require_essh(cfg: Any, what: str) -> ESSHConfig:
    if not isinstance(cfg, _FRACTION_TIERS):
        raise TypeError(f"{what} is the ESSH two-rate map (Eq. 7); got {type(cfg).__name__}")
    return cfg


def channels_for(cfg: ESSHConfig, xi: float | Fraction) -> int:
    """Retained spectral channels ``K_T = max(1, round(K-bar xi^{1/2}))`` (Eq. 7).

    ``round`` is Python's (half to even), applied to the exact value; DESIGN.md notes that no training
    or deployment budget lands on a .5 tie. The exponent is ``cfg.channel_exponent``.
    """
    if not isinstance(cfg, ESSHConfig):
        raise TypeError(f"channels_for is the ESSH channel map (Eq. 7); got {type(cfg).__name__}")
    v = _scaled_power(cfg.n_channels, xi, cfg.channel_exponent)
    return max(1, int(v.to_integral_value(rounding=ROUND_HALF_EVEN)))


def ffn_width_for(cfg: ESSHConfig, xi: float | Fraction) -> int:
    """Retained FFN width ``n_ff = align max(1, floor(d_ff xi^{0.8} / align))`` (Eq. 7, Figure 5).

    The floor is taken of a 50-digit decimal evaluation, so values that are exact multiples of
    ``align`` in exact arithmetic (e.g. ``xi = 1``) are never pushed down by binary rounding.
    """
    cfg = _require_essh(cfg, "ffn_width_for")
    if isinstance(cfg, TransformerConfig) and xi == 1:
        return cfg.d_ff                          # the nested map's full tier keeps every unit
    v = _scaled_power(cfg.d_ff, xi, cfg.ffn_exponent) / Decimal(cfg.ffn_align)
    return cfg.ffn_align * max(1, int(v.to_integral_value(rounding=ROUND_FLOOR)))


# ---- tier tables and resolution --------------------------------------------------------------------
def _essh_tier(cfg: ESSHConfig | TransformerConfig, index: int) -> Tier:
    xi = cfg.tier_xi[index - 1]
    return _fraction_tier(cfg, f"T{index}", index, xi)


def _fraction_tier(cfg: ESSHConfig | TransformerConfig, name: str, index: int, xi: float) -> Tier:
    if isinstance(cfg, TransformerConfig):
        n_ff = min(cfg.d_ff, ffn_width_for(cfg, xi))
        return Tier(name, index, float(xi), 0, n_ff, cfg.num_parameters(n_ff))
    K, n_ff = channels_for(cfg, xi), ffn_width_for(cfg, xi)
    return Tier(name, index, float(xi), K, n_ff, _essh_params(cfg, K, n_ff)["total"])


def capacity_tier(cfg: ESSHConfig, xi: float) -> Tier:
    """The tier of an arbitrary budget fraction ``xi`` in (0, 1] through Eq. 7 (training capacities of
    D.4 such as 3/32 need not be deployment tiers). Named ``"xi=<xi>"`` with ``index`` 0."""
    _require_essh(cfg, "capacity_tier")
    if not 0 < xi <= 1:
        raise ValueError(f"a capacity fraction must lie in (0, 1], got {xi}")
    return _fraction_tier(cfg, f"xi={xi:g}", 0, xi)


def _essm_tier(cfg: ESSSMConfig, K: int) -> Tier:
    index = cfg.budgets.index(K) + 1 if K in cfg.budgets else 0
    n_ff = cfg.d_model * cfg.ffn_mult
    return Tier(f"K{K}", index, K / cfg.n_channels, K, n_ff, _essm_params(cfg, K)["total"])


def tier_table(cfg: AnyConfig) -> list[Tier]:
    """All deployment tiers of ``cfg``, smallest first.

    ESSH: one tier per ``cfg.tier_xi`` entry through Eq. 7 (Table 6 with the default ten budgets).
    ES-SSM: one tier per runtime budget in ``cfg.budgets``.
    """
    if isinstance(cfg, _FRACTION_TIERS):
        return [_essh_tier(cfg, i) for i in range(1, len(cfg.tier_xi) + 1)]
    if isinstance(cfg, ESSSMConfig):
        return [_essm_tier(cfg, K) for K in cfg.budgets]
    raise TypeError(f"tier_table needs an ESSHConfig or ESSSMConfig, got {type(cfg).__name__}")


def _bad_tier(cfg: AnyConfig, tier: Any) -> ValueError:
    names = [t.name for t in tier_table(cfg)]
    if isinstance(cfg, _FRACTION_TIERS):
        hint = f"use None (full), a Tier, or one of {names}"
    else:
        hint = (f"use None (full), a Tier, an int K in [1, {cfg.n_channels}] or 'K<k>'"
                f" (trained budgets: {names})")
    return ValueError(f"unknown tier {tier!r} for {type(cfg).__name__}: {hint}")


def resolve_tier(cfg: AnyConfig, tier: Any = None) -> Tier:
    """Turn a user-facing tier spec into a ``Tier`` of ``cfg``.

    ESSH accepts ``None`` (full tier), a ``Tier``, a name ``"T<i>"`` (case-insensitive) or a float
    capacity fraction ``xi`` (``capacity_tier``).
    ES-SSM accepts ``None``, a ``Tier``, an int ``K`` in ``[1, K-bar]`` or ``"K<k>"``; a ``K`` outside
    ``cfg.budgets`` is allowed and gets ``index`` 0. A ``Tier`` must equal the tier of the same name
    computed from ``cfg`` (a tier of another config is refused). Anything else raises ``ValueError``
    that lists the valid names.
    """
    table = tier_table(cfg)
    if tier is None:
        return table[-1]
    if isinstance(tier, Tier) and isinstance(cfg, _FRACTION_TIERS) and tier.index == 0:
        own = capacity_tier(cfg, tier.xi)
        if own != tier:
            raise ValueError(f"{tier} does not belong to this config; its xi={tier.xi:g} tier is {own}")
        return own
    if isinstance(tier, float) and isinstance(cfg, _FRACTION_TIERS):
        if not 0 < tier <= 1:
            raise _bad_tier(cfg, tier)
        return capacity_tier(cfg, tier)
    if isinstance(tier, Tier):
        own = resolve_tier(cfg, tier.name)
        if own != tier:
            raise ValueError(f"{tier} does not belong to this config; its {tier.name} is {own}")
        return own
    if isinstance(cfg, _FRACTION_TIERS):
        m = re.fullmatch(r"[tT](\d+)", tier) if isinstance(tier, str) else None
        if m and 1 <= int(m.group(1)) <= len(table):
            return table[int(m.group(1)) - 1]
        raise _bad_tier(cfg, tier)
    if isinstance(tier, str):
        m = re.fullmatch(r"[kK](\d+)", tier.strip())
        K = int(m.group(1)) if m else None
    else:
        K = tier if isinstance(tier, int) and not isinstance(tier, bool) else None
    if K is None or not 1 <= K <= cfg.n_channels:
        raise _bad_tier(cfg, tier)
    return _essm_tier(cfg, K)


# ---- parameter counts (ESSH Eq. 25 / Table 4; ES-SSM Sec. 4) ----------------------------------------
def _essh_params(cfg: ESSHConfig, K: int, n_ff: int) -> dict[str, int]:
    d, m, P, N = cfg.d_model, cfg.n_modes, cfg.value_width, cfg.n_layers
    out = {
        "embedding": cfg.vocab_size * d,
        "head": 0 if cfg.tie_embeddings else cfg.vocab_size * d,
        "norms": 2 * d * N + d,  # two RMSNorm weights per block + the final norm
        "attention": 4 * d * d * len(cfg.swa_layers),  # q, k, v, o without biases
        # per retained channel: value in/out 2dP, write/read/clock (md + m) each,
        # rho/theta/kc/ks/a (5m), blend beta (1)  ->  2dP + 3md + 8m + 1
        "spectral": cfg.n_spectral_layers * K * (2 * d * P + 3 * m * d + 8 * m + 1),
        "ffn": 3 * d * n_ff * N,  # SwiGLU gate/up/down in every block
    }
    out["total"] = sum(out.values())
    return out


def _essm_params(cfg: ESSSMConfig, K: int) -> dict[str, int]:
    d, dg, N = cfg.d_model, cfg.gate_hidden, cfg.n_layers
    n_ff = d * cfg.ffn_mult
    lm = cfg.task == "lm"
    out = {
        "embedding": cfg.vocab_size * d,
        "head": (0 if cfg.tie_embeddings else cfg.vocab_size * d) if lm
        else d * cfg.num_classes + cfg.num_classes,
        "norms": N * 4 * d + 2 * d,  # LN1, LN2 (weight + bias) per block + final LayerNorm
        "gate": N * (dg * d + dg + K * dg + K),  # W_g1, b_g1, retained rows of W_g2, b_g2
        "spectral": N * K * d * d,  # M_k, dense d x d per retained channel, no bias
        "ffn": N * (2 * d * n_ff + n_ff + d),  # d -> n_ff -> d with biases
    }
    out["total"] = sum(out.values())
    return out


def parameter_breakdown(cfg: AnyConfig, tier: Any = None) -> dict[str, int]:
    """Parameter count of ``tier``'s standalone export by component, plus ``"total"``.

    ESSH keys: embedding, head (untied only), norms, attention, spectral, ffn (Eq. 25: the fixed term is
    embedding + head + norms + attention). ES-SSM keys: embedding, head, norms, gate, spectral, ffn.
    """
    t = resolve_tier(cfg, tier)
    if isinstance(cfg, TransformerConfig):
        d, N = cfg.d_model, cfg.n_layers
        out = {"embedding": cfg.vocab_size * d, "head": 0 if cfg.tie_embeddings else cfg.vocab_size * d,
               "norms": 2 * d * N + d, "attention": 4 * d * d * N, "ffn": 3 * d * t.n_ff * N}
        return {**out, "total": sum(out.values())}
    if isinstance(cfg, ESSHConfig):
        return _essh_params(cfg, t.K, t.n_ff)
    return _essm_params(cfg, t.K)


def num_parameters(cfg: AnyConfig, tier: Any = None) -> int:
    """Exact parameter count of the standalone export of ``tier`` (ESSH Eq. 25; Table 4, Table 6)."""
    return resolve_tier(cfg, tier).params


# ---- persistent state (C.5, Table 5, Table 53) ------------------------------------------------------
def state_bytes(
    cfg: AnyConfig, tier: Any = None, batch: int = 1, state_dtype_bytes: int = 4, kv_dtype_bytes: int = 2,
    decode: str = "exact", n_modes: int = 8, context: int = 2048,
) -> dict[str, int]:
    """Persistent per-batch decoding state in bytes: ``recurrent``, ``kv`` and ``total``.

    ESSH: ``recurrent = 2 (N - |A|) K_T m P`` entries (C.5) in ``state_dtype_bytes`` (fp32 in Table 53);
    ``kv = |A| * 2 * window * d`` entries (K and V of every SWA layer, a full window ring buffer) in
    ``kv_dtype_bytes`` (bf16 in Table 53). ES-SSM (``decode``, ``n_modes`` apply to it only): the LTI
    spectral sublayer has no finite recurrent realisation, so exact causal decoding (``decode='exact'``)
    keeps the last ``L - 1`` normalised inputs of every block (``recurrent = N (L - 1) d`` entries,
    whatever K); the modal decoder (``decode='modal'``, m = ``n_modes`` damped-rotation modes per retained
    channel) keeps ``recurrent = 2 N K m d`` entries. ``kv = 0``. Equal to ``ESSSMCache.nbytes()``.
    Transformer++ / MatFormer: ``kv = N * 2 * context * d`` entries (full attention), ``recurrent = 0``.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    t = resolve_tier(cfg, tier)
    if isinstance(cfg, TransformerConfig):    # full attention: K and V of every layer for ``context`` tokens
        rec, kv = 0, cfg.n_layers * 2 * context * cfg.d_model
    elif isinstance(cfg, ESSHConfig):
        rec = 2 * cfg.n_spectral_layers * t.K * cfg.n_modes * cfg.value_width
        kv = len(cfg.swa_layers) * 2 * cfg.window * cfg.d_model
    elif decode == "exact":
        rec = cfg.n_layers * (cfg.seq_len - 1) * cfg.d_model
        kv = 0
    elif decode == "modal":
        rec = 2 * cfg.n_layers * t.K * n_modes * cfg.d_model
        kv = 0
    else:
        raise ValueError(f"unknown decode mode {decode!r}; use 'exact' or 'modal'")
    out = {"recurrent": batch * rec * state_dtype_bytes, "kv": batch * kv * kv_dtype_bytes}
    out["total"] = out["recurrent"] + out["kv"]
    return out


# ---- arithmetic (C.5, Table 5) ------------------------------------------------------------------------
def flops_per_token(cfg: AnyConfig, tier: Any = None, context: int = 2048) -> dict[str, int]:
    """Per-token FLOPs (one multiply-accumulate = 2 FLOPs, C.5) of ``tier`` by component, plus ``total``.

    ESSH, summed over blocks:
      ``projection`` 2 (2 d K_T P + 3 d K_T m) per spectral block (value in/out + selective rows, C.5);
      ``ffn`` 2 * 3 d n_ff per block (SwiGLU, every block);
      ``attention`` 2 (4 d^2 + 2 d min(context, window)) per SWA block (projections + scores/values);
      ``scan`` 2 K_T (7 m P + 3 P) per spectral block: the recurrent step of Eq. 9 (decayed rotation
      4mP, write mP, read-out 2mP), the zero-lag correction (Eq. 24, P) and the value blend (Eq. 23, 2P);
      ``head`` 2 d V. Elementwise gate nonlinearities and norms are not counted.
    ES-SSM, summed over blocks, ``context`` = sequence length T:
      ``projection`` 2 (K d^2 + d d_g + d_g K) (M_k and the gate MLP); ``ffn`` 2 * 2 d n_ff;
      ``scan`` the FFT convolution at length 2T amortised per token, ``5 d (K + 1) log2(2T) + 6 K d``
      (one forward real FFT of the input, K pointwise products, K inverse real FFTs), rounded;
      ``attention`` 0; ``head`` 2 d V (LM) or 2 d C / T (classification: one pooled head per sequence).
    """
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    t = resolve_tier(cfg, tier)
    d, K = cfg.d_model, t.K
    if isinstance(cfg, TransformerConfig):
        return cfg.flops_per_token(context, t.n_ff)
    if isinstance(cfg, ESSHConfig):
        m, P, S, A = cfg.n_modes, cfg.value_width, cfg.n_spectral_layers, len(cfg.swa_layers)
        out = {
            "projection": 2 * S * (2 * d * K * P + 3 * d * K * m),
            "ffn": 2 * cfg.n_layers * 3 * d * t.n_ff,
            "attention": 2 * A * (4 * d * d + 2 * d * min(context, cfg.window)),
            "scan": 2 * S * K * (7 * m * P + 3 * P),
            "head": 2 * d * cfg.vocab_size,
        }
    else:
        N, dg = cfg.n_layers, cfg.gate_hidden
        fft = 5 * d * (K + 1) * math.log2(2 * context) + 6 * K * d
        head = 2 * d * cfg.vocab_size if cfg.task == "lm" else 2 * d * cfg.num_classes / context
        out = {
            "projection": 2 * N * (K * d * d + d * dg + dg * K),
            "ffn": 2 * N * 2 * d * t.n_ff,
            "attention": 0,
            "scan": round(N * fft),
            "head": round(head),
        }
    out["total"] = sum(out.values())
    return out


# ---- readable output ----------------------------------------------------------------------------------
def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(int(n))


def format_tier_table(rows: Iterable[Tier], cfg: AnyConfig | None = None, batch: int = 1,
                      n_modes: tuple[int, ...] = (4, 8, 16)) -> str:
    """A plain-text table of tiers: name, xi, K, n_ff, params (exact and rounded) and fraction r.

    With ``cfg`` (the config the rows come from) it adds the persistent state of ``state_bytes`` at
    ``batch`` in decimal MB: ESSH recurrent fp32, KV bf16 and total; ES-SSM the fp32 decode state of the
    exact ring buffer and of the modal decoder at each m in ``n_modes``.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("format_tier_table needs at least one Tier")
    full = max(r.params for r in rows) if cfg is None else num_parameters(cfg)
    head = ["tier", "xi", "K", "n_ff", "params", "", "r"]
    essm = isinstance(cfg, ESSSMConfig)
    body = []
    for r in rows:
        line = [r.name, f"{r.xi:.4f}", str(r.K), str(r.n_ff), f"{r.params:,}", _human(r.params),
                f"{r.params / full:.3f}"]
        if essm:
            modes = [("modal", m) for m in n_modes]
            line += [f"{state_bytes(cfg, r, batch=batch, decode=d, n_modes=m)['total'] / 1e6:.3f}"
                     for d, m in [("exact", 8), *modes]]
        elif cfg is not None:
            sb = state_bytes(cfg, r, batch=batch)
            line += [f"{sb[k] / 1e6:.2f}" for k in ("recurrent", "kv", "total")]
        body.append(line)
    if essm:
        head += ["exact MB"] + [f"modal m={m} MB" for m in n_modes]
    elif cfg is not None:
        head += ["state MB", "KV MB", "total MB"]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    rule = "-" * len(fmt(head))
    return "\n".join([fmt(head), rule, *map(fmt, body)])
