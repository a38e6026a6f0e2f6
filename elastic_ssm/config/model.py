"""``ModelConfig``: what an architecture declares (tier table, ``parse_tier``, exact counts: ``tier_parameters``
Eq. 25 / Table 4, ``tier_state`` C.5 / Table 53, ``tier_flops``; standalone and specialist configs, recipes); a
subclass with an ``arch`` registers itself (``model_configs()``). ``FractionTierConfig``: tiers ``T1..Tn`` over
``tier_xi`` and any capacity fraction in (0, 1] through Eq. 7 (ESSH and the Transformer++ baselines)."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any, ClassVar

from .base import ConfigBase, ConfigError

__all__ = ["Tier", "TierLike", "ModelConfig", "FractionTierConfig", "model_configs", "scaled_power", "tier_word"]


@dataclass(frozen=True)
class Tier:
    """One deployment tier: ``name`` ``"T<n>"`` (ES-SSM ``"K<k>"``), ``index`` its 1-based place in the tier table
    (0 for a capacity fraction or an untrained budget), ``xi`` the budget variable of Eq. 7 (ES-SSM ``K / K-bar``),
    retained ``K`` channels and ``n_ff`` FFN units, ``params`` of the standalone export (exact)."""

    name: str
    index: int
    xi: float
    K: int
    n_ff: int
    params: int


#: What a ``tier=`` argument accepts: None (the full tier), a ``Tier`` of the config, a name ("T4"; ES-SSM
#: "K8"), an ES-SSM budget (int K) or an ESSH / Transformer++ capacity fraction (float in (0, 1]).
TierLike = str | int | float | Tier | None


def tier_word(word: TierLike) -> TierLike:
    """A tier as written on the command line (``--tiers``, ``--tier``, lm-eval's ``tier=``, ``model.tier_config``)
    as ``resolve_tier`` takes it: an all-digit word is an int (an ES-SSM budget), another word is itself stripped;
    a non-string is returned as it is."""
    if not isinstance(word, str):
        return word
    word = word.strip()
    return int(word) if word.isascii() and word.isdigit() else word


_REGISTRY: dict[str, type[ModelConfig]] = {}


def model_configs() -> dict[str, type[ModelConfig]]:
    """Model config class of every ``model.arch`` (the two papers' models and the baselines, E.6)."""
    return dict(_REGISTRY)


# ---- Eq. 7 arithmetic, exact --------------------------------------------------------------------------
def exact_decimal(x: float | int | Fraction) -> Decimal:
    """The exact decimal a number denotes (a float by its shortest repr, so 0.8 means 4/5)."""
    if isinstance(x, Fraction):
        return Decimal(x.numerator) / Decimal(x.denominator)
    return Decimal(repr(float(x))) if isinstance(x, float) else Decimal(int(x))


def check_fraction(xi: Any, what: str = "a capacity fraction") -> None:
    """A ``ValueError`` unless ``xi`` is a number in (0, 1] (NaN was decimal.InvalidOperation, a str a TypeError)."""
    if isinstance(xi, bool) or not isinstance(xi, numbers.Real) or not 0 < xi <= 1:
        raise ValueError(f"{what} must lie in (0, 1], got {xi!r}")


@functools.lru_cache(maxsize=4096)
def scaled_power(total: int, xi: float | Fraction, exponent: float) -> Decimal:
    """``total * xi ** exponent`` to 50 significant digits (correctly rounded ``Decimal`` power). Cached: every
    ``resolve_tier`` builds the tier table through it, and a server resolves tiers per request and row."""
    check_fraction(xi, "budget variable xi")
    xi_d = exact_decimal(xi)
    with localcontext() as ctx:
        ctx.prec = 50
        return Decimal(total) * xi_d ** exact_decimal(exponent)


class ModelConfig(ConfigBase):
    """Base of the model configs: an architecture's tiers and exact costs (see the module docstring)."""

    arch: ClassVar[str] = ""
    #: recipes that need this architecture ('capacity_mixed' and 'refine' are ESSH's, 'budget_dropout' ES-SSM's)
    elastic_recipes: ClassVar[tuple[str, ...]] = ()
    #: the field that bounds the input length ('' when any length runs; ES-SSM: ``seq_len``, its filter length L)
    length_field: ClassVar[str] = ""
    #: fields added after a release -> the value that reproduces the older version (``upgrade_record``); a resumed
    #: run keeps it unless the command line sets the field (``pipeline._kept_added_fields``)
    added_fields: ClassVar[dict[str, Any]] = {}
    #: fields a resume may change: they change no weight and no loss (a tier's name)
    RESUME_FREE: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("arch"):
            _REGISTRY[cls.arch] = cls

    @classmethod
    def upgrade_record(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A ``model`` record (``to_dict()``) of an earlier version (an old ``run.yaml`` or checkpoint) with every
        ``added_fields`` entry it lacks set to the value that version behaved as, so a run resumes."""
        return {**cls.added_fields, **d} if isinstance(d, dict) else d

    def validate(self) -> None:
        """The rule every architecture shares: a ``*_token_id`` field is -1 or a token id < ``vocab_size``."""
        for name in sorted(n for n in self.field_names() if n.endswith("_token_id")):
            if not getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{type(self).__name__}.{name}={getattr(self, name)} must be -1 or a token id < "
                                  "vocab_size")

    def max_seq_len(self) -> int | None:
        """The longest sequence the model accepts (its ``length_field``); None when there is no limit."""
        return getattr(self, self.length_field) if self.length_field else None

    # ---- tiers -------------------------------------------------------------------------------------
    def tier_table(self) -> list[Tier]:
        """All deployment tiers, smallest first."""
        raise NotImplementedError

    def parse_tier(self, spec: Any) -> Tier | None:
        """The tier a name / number denotes, or None when ``spec`` is not one this architecture accepts."""
        raise NotImplementedError

    def tier_hint(self) -> str:
        """What ``resolve_tier`` accepts, for its error message."""
        return (f"give one of {[t.name for t in self.tier_table()]} or the full model (None in Python, 'full' on the "
                "command line)")

    def own_tier(self, tier: Tier) -> Tier:
        """This config's tier of the same name (what a ``Tier`` argument must equal)."""
        return self.resolve_tier(tier.name)

    def resolve_tier(self, tier: TierLike = None) -> Tier:
        """A tier spec as a ``Tier`` of this config: None is the full tier, a ``Tier`` must be this config's own,
        anything else goes through ``parse_tier``; a ``ValueError`` lists the valid names."""
        if tier is None:
            return self.tier_table()[-1]
        if isinstance(tier, Tier):
            own = self.own_tier(tier)
            if own != tier:
                what = f"xi={tier.xi:g} tier" if tier.index == 0 and tier.name.startswith("xi=") else tier.name
                raise ValueError(f"{tier} does not belong to this config; its {what} is {own}")
            return own
        t = self.parse_tier(tier)
        if t is None:
            raise ValueError(f"unknown tier {tier!r} for {type(self).__name__}: {self.tier_hint()}")
        return t

    # ---- exact costs of a tier ------------------------------------------------------------------------
    def tier_parameters(self, tier: Tier) -> dict[str, int]:
        """Parameters of ``tier``'s standalone export by component, plus ``"total"``."""
        raise NotImplementedError

    def tier_state(self, tier: Tier, decode: str = "exact", n_modes: int = 8, context: int = 2048) -> tuple[int, int]:
        """Persistent decode state of one sequence in entries: ``(recurrent, kv)``."""
        raise NotImplementedError

    def tier_flops(self, tier: Tier, context: int = 2048) -> dict[str, int]:
        """Per-token FLOPs (2 per multiply-accumulate) by component, plus ``"total"``."""
        raise NotImplementedError

    def state_columns(self, tier: Tier, state_bytes: Any, batch: int,
                      n_modes: tuple[int, ...]) -> list[tuple[str, str]]:
        """Extra ``(header, cell)`` columns of ``format_tier_table``: state MB, KV MB and total MB (decimal)
        at ``batch``; ``state_bytes`` is ``elastic.tiers.state_bytes``."""
        sb = state_bytes(self, tier, batch=batch)
        return [(h, f"{sb[k] / 1e6:.2f}") for h, k in
                (("state MB", "recurrent"), ("KV MB", "kv"), ("total MB", "total"))]

    # ---- configs derived from a tier -------------------------------------------------------------------
    def standalone_config(self, tier: Tier) -> ModelConfig:
        """The config of ``tier``'s standalone export (only the retained sizes)."""
        raise NotImplementedError

    def specialist_config(self, tier: Tier) -> ModelConfig:
        """The config of an independent model of ``tier``'s shape trained from scratch (Table 43)."""
        return self.standalone_config(tier)

    def default_recipe(self) -> str:
        """The recipe ``train.recipe='auto'`` picks: 'dense' for a model with one tier."""
        return "dense"


class FractionTierConfig(ModelConfig):
    """Tiers ``T1..Tn`` over ``tier_xi``, any capacity fraction through Eq. 7. ``tier_names`` (empty: ``T1..Tn``)
    renames them: a standalone export of ``T4`` has one tier and keeps the name ``T4`` (``standalone_config``).
    Both such architectures (ESSH, Transformer++) have attention heads of ``head_dim`` over ``d_model``."""

    tier_xi: tuple[float, ...]
    tier_names: tuple[str, ...]
    #: runs saved before ``tier_names`` existed named every tier ``T<index>``: empty names
    added_fields: ClassVar[dict[str, Any]] = {"tier_names": []}
    RESUME_FREE: ClassVar[frozenset[str]] = frozenset({"tier_names"})
    d_model: int
    head_dim: int
    d_ff: int
    ffn_exponent: float
    ffn_align: int

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def fraction_tier(self, name: str, index: int, xi: float) -> Tier:
        """The tier of capacity fraction ``xi`` (its K, n_ff and exact parameter count)."""
        raise NotImplementedError

    def ffn_width_for(self, xi: float | Fraction) -> int:
        """Retained FFN width ``n_ff = align max(1, floor(d_ff xi^e / align))`` (Eq. 7, Figure 5), the floor of a
        50-digit decimal value (an exact multiple of ``align`` is never pushed down by binary rounding)."""
        v = scaled_power(self.d_ff, xi, self.ffn_exponent) / Decimal(self.ffn_align)
        return self.ffn_align * max(1, int(v.to_integral_value(rounding=ROUND_FLOOR)))

    def capacity_tier(self, xi: float) -> Tier:
        """The tier of an arbitrary budget fraction ``xi`` in (0, 1] (training capacities of D.4 such as
        3/32 need not be deployment tiers). Named ``"xi=<xi>"`` with ``index`` 0."""
        check_fraction(xi)
        return self.fraction_tier(f"xi={xi:g}", 0, xi)

    def tier_name(self, index: int) -> str:
        """Name of the ``index``-th (1-based) tier: its ``tier_names`` entry, or ``T<index>``."""
        return self.tier_names[index - 1] if self.tier_names else f"T{index}"

    def validate(self) -> None:
        """``d_model`` splits into heads; ``tier_names`` is empty or names each ``tier_xi`` entry."""
        super().validate()
        if self.d_model % self.head_dim:
            raise ConfigError(f"{type(self).__name__}.d_model={self.d_model} must be divisible by "
                              f"head_dim={self.head_dim}")
        if self.tier_names and len(self.tier_names) != len(self.tier_xi):
            raise ConfigError(f"{type(self).__name__}.tier_names must name each of the {len(self.tier_xi)} tier_xi "
                              f"entries, got {list(self.tier_names)}")

    def tier_table(self) -> list[Tier]:
        """``T1..Tn``, kept with the field values it was built from (``resolve_tier`` of every request and row
        reads it; a changed field builds it again)."""
        key = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        kept = self.__dict__.get("_tier_table")
        if kept is None or kept[0] != key:
            kept = key, [self.fraction_tier(self.tier_name(i), i, xi) for i, xi in enumerate(self.tier_xi, 1)]
            self.__dict__["_tier_table"] = kept
        return list(kept[1])

    def own_tier(self, tier: Tier) -> Tier:
        return self.capacity_tier(tier.xi) if tier.index == 0 else self.resolve_tier(tier.name)

    def parse_tier(self, spec: Any) -> Tier | None:
        if isinstance(spec, float):
            return self.capacity_tier(spec) if 0 < spec <= 1 else None
        m = re.fullmatch(r"[tT](\d+)", spec.strip()) if isinstance(spec, str) else None
        if m is None:
            return None
        number = int(m.group(1))
        if self.tier_names:      # a renamed table (an export): only its own names
            name = f"T{number}"
            return self.tier_table()[self.tier_names.index(name)] if name in self.tier_names else None
        return self.tier_table()[number - 1] if 1 <= number <= len(self.tier_xi) else None

    def standalone_names(self, tier: Tier) -> tuple[str, ...]:
        """``tier_names`` of ``tier``'s standalone export: its own name (a capacity fraction's export, index 0,
        is ``T1`` of its own table)."""
        return (tier.name,) if tier.index else ()

    def standalone_config(self, tier: Tier) -> ModelConfig:
        return self.replace(d_ff=tier.n_ff, tier_xi=(1.0,),   # type: ignore[return-value]
                            tier_names=self.standalone_names(tier))
