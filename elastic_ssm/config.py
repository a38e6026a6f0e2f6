"""Model configurations: keyword-only dataclass trees with field docs, validation and YAML round trip.

Every field carries a one-line ``help`` in its metadata; the CLI derives its flags from these
dataclasses (never from a hand-kept flag list). ``ConfigBase.from_dict`` rejects unknown keys and
``validate`` names the offending field, so a typo in a YAML file is an error, not a silent default.

Presets reproduce the ESSH paper's Table 7 ("370m", "1.5b") and add small CPU presets
("tiny" for tests, "small" for the laptop quickstart); ES-SSM presets: "byte-base", "1.3b" (shape inferred
from the paper's parameter count, see ``ESSSM_PRESETS``), "tiny", "small".
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

__all__ = ["ConfigBase", "ESSSMConfig", "ESSHConfig", "ConfigError", "opt"]

#: Budget fractions xi_T of the ten ESSH deployment tiers (Appendix D.1, Table 6).
ESSH_TIER_XI = tuple(n / 32 for n in (2, 4, 7, 10, 13, 17, 20, 24, 28, 32))
#: Default ES-SSM runtime-budget set (ES-SSM paper, Sec. 4.2).
ESSSM_BUDGETS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to do."""


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a default and a one-line help text (used by the CLI)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or default_factory for mutable defaults")
    return field(default=default, metadata={"help": help}, **kw)


def _coerce(tp: Any, value: Any, name: str) -> Any:
    """Coerce a YAML/JSON value to the annotated field type (tuples, nested configs, optionals)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, name)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return tp.from_dict(value)
    if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
        raise ConfigError(f"{name}: expected a mapping of {tp.__name__} fields, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return tuple(_coerce(item, v, name) for v in value)
    if tp in (int, float) and isinstance(value, bool):  # YAML `steps: true` is not the number 1
        raise ConfigError(f"{name}: expected {tp.__name__}, got the boolean {value!r}")
    if tp is float and isinstance(value, int):
        value = float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads 3e-4 without a dot as a string; accept any number float() parses
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{name}: expected float, got {value!r}") from None
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
    return value


@dataclass(kw_only=True)
class ConfigBase:
    """Shared behaviour: validation hook, dict/YAML round trip, ``replace``."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(hints[f.name], getattr(self, f.name), f.name))
        self.validate()

    def validate(self) -> None:  # overridden by subclasses
        """Raise ``ConfigError`` naming the bad field."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, ConfigBase):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfigBase:
        if not isinstance(d, dict):
            raise ConfigError(f"{cls.__name__}: expected a mapping of field names to values, got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"{cls.__name__}: unknown field(s) {unknown}; valid fields are {sorted(names)}"
            )
        return cls(**d)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> ConfigBase:
        """Load from a YAML file path, or from YAML text (anything containing a newline or ':')."""
        is_text = isinstance(path_or_text, str) and ("\n" in path_or_text or ":" in path_or_text)
        if is_text:
            text = str(path_or_text)
        else:
            p = Path(path_or_text)
            if not p.is_file():
                raise ConfigError(f"{cls.__name__}: config file {p} does not exist")
            text = p.read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.__name__}: YAML must be a mapping of field names, got {type(data)}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ConfigBase:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def _positive(cfg: ConfigBase, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        if not v > 0:
            raise ConfigError(f"{type(cfg).__name__}.{n} must be > 0, got {v!r}")


@dataclass(kw_only=True)
class ESSSMConfig(ConfigBase):
    """ES-SSM (LTI spectral sublayer, ES-SSM paper Sec. 4): byte-level LM or sequence classifier."""

    arch: ClassVar[str] = "es_ssm"

    vocab_size: int = opt(260, "input vocabulary (bytes 0-255 plus pad/bos/eos/sep specials)")
    d_model: int = opt(256, "residual width d")
    n_layers: int = opt(4, "number of ES-SSM blocks")
    n_channels: int = opt(32, "full spectral budget K-bar (Hankel channels)")
    seq_len: int = opt(1024, "filter length L: the longest sequence the model accepts")
    budgets: tuple[int, ...] = opt(ESSSM_BUDGETS, "runtime-budget set (channel counts) for training/export")
    gate_hidden_ratio: float = opt(0.5, "gate-MLP hidden width d_g as a fraction of d (paper: 1/2)")
    gate_bias_init: float = opt(-2.0, "initial gate-logit bias b_g2 (paper: -2, sigmoid ~ 0.12)")
    ffn_mult: int = opt(4, "GELU FFN widening factor")
    drop_path: float = opt(0.0, "stochastic-depth rate on both residual branches")
    dropout: float = opt(0.0, "dropout inside the FFN")
    norm_eps: float = opt(1e-5, "LayerNorm epsilon")
    task: str = opt("lm", "'lm' (next-token) or 'classify' (mean-pooled sequence classification)")
    num_classes: int = opt(0, "classes for task='classify'")
    tie_embeddings: bool = opt(True, "tie the LM head to the input embedding")
    init_std: float = opt(0.02, "std of normal initialisation for projections and embeddings")
    eos_token_id: int = opt(-1, "end-of-sequence token id that stops generation (-1: none)")

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_channels", "seq_len", "ffn_mult")
        if not -1 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"ESSSMConfig.eos_token_id={self.eos_token_id} must be -1 or a token id < vocab_size")
        if self.task not in ("lm", "classify"):
            raise ConfigError(f"ESSSMConfig.task must be 'lm' or 'classify', got {self.task!r}")
        if self.task == "classify" and self.num_classes < 2:
            raise ConfigError("ESSSMConfig.num_classes must be >= 2 when task='classify'")
        if not self.budgets or any(not 1 <= k <= self.n_channels for k in self.budgets):
            raise ConfigError(
                f"ESSSMConfig.budgets must be channel counts in [1, n_channels={self.n_channels}],"
                f" got {self.budgets}"
            )
        if tuple(sorted(set(self.budgets))) != self.budgets:
            raise ConfigError(f"ESSSMConfig.budgets must be strictly increasing, got {self.budgets}")
        if self.budgets[-1] != self.n_channels:
            raise ConfigError("ESSSMConfig.budgets must end with the full budget n_channels")
        if not 0.0 <= self.drop_path < 1.0 or not 0.0 <= self.dropout < 1.0:
            raise ConfigError("ESSSMConfig.drop_path and dropout must lie in [0, 1)")
        if self.d_model * self.gate_hidden_ratio < 1:
            raise ConfigError("ESSSMConfig.gate_hidden_ratio * d_model must be >= 1")

    @property
    def gate_hidden(self) -> int:
        return max(1, int(round(self.d_model * self.gate_hidden_ratio)))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ESSSMConfig:
        """A named configuration (``ESSSM_PRESETS``) with ``overrides``."""
        if name not in ESSSM_PRESETS:
            raise ConfigError(f"unknown ES-SSM preset {name!r}; choose one of {sorted(ESSSM_PRESETS)}")
        return cls(**{**ESSSM_PRESETS[name], **overrides})


@dataclass(kw_only=True)
class ESSHConfig(ConfigBase):
    """ESSH hybrid (ESSH paper Sec. 4, Table 7): spectral mixers + sliding-window attention + SwiGLU."""

    arch: ClassVar[str] = "essh"

    vocab_size: int = opt(50304, "vocabulary size V (tied embedding)")
    d_model: int = opt(896, "residual width d")
    n_layers: int = opt(22, "number of blocks (spectral + SWA)")
    d_ff: int = opt(4608, "full SwiGLU width d_ff")
    n_channels: int = opt(32, "full spectral-channel count K-bar")
    n_modes: int = opt(8, "damped-rotation modes m per channel")
    channel_width: int = opt(0, "value width P per channel; 0 means d / n_channels (standalone exports set it)")
    swa_layers: tuple[int, ...] = opt((12, 17, 21), "zero-based indices of sliding-window-attention blocks")
    window: int = opt(2048, "sliding-window length w (tokens attended, including the current one)")
    head_dim: int = opt(64, "attention head dimension (heads = d / head_dim)")
    rope_base: float = opt(10000.0, "RoPE base frequency (paper silent; 10000 as in Su et al.)")
    filter_length: int = opt(2048, "Hankel length L of the filters the modal tables are fitted to (C.1)")
    tier_xi: tuple[float, ...] = opt(ESSH_TIER_XI, "budget fractions xi_T of the deployment tiers (D.1)")
    channel_exponent: float = opt(0.5, "two-rate map: K_T = max(1, round(K xi^e)) (Eq. 7)")
    ffn_exponent: float = opt(0.8, "two-rate map: n_ff = align * max(1, floor(d_ff xi^e / align)) (Eq. 7)")
    ffn_align: int = opt(64, "FFN width alignment of the two-rate map (Eq. 7: 64)")
    tie_embeddings: bool = opt(True, "tie the LM head to the token embedding")
    norm_eps: float = opt(1e-6, "RMSNorm epsilon")
    blend_eps: float = opt(1e-6, "epsilon_norm of the channel-local value blend (Eq. 23)")
    clock_bias_init: float = opt(-3.0, "clock bias initialisation (C.2: softplus(-3) ~ 0.0486)")
    zero_lag_init: float = opt(0.5, "zero-lag coefficient a initialisation (C.3)")
    pole_clip: float = opt(1.0 - 1e-4, "matrix-pencil pole-magnitude clip (DESIGN: 1 - 1e-4)")
    init_std: float = opt(0.02, "std of normal initialisation for projections and embeddings")
    pad_token_id: int = opt(-1, "padding token id for batched generation (-1: none)")
    eos_token_id: int = opt(-1, "end-of-sequence token id (-1: none)")

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "d_ff", "n_channels", "n_modes",
                  "window", "head_dim", "filter_length", "ffn_align")
        if self.channel_width < 0:
            raise ConfigError(f"ESSHConfig.channel_width must be >= 0, got {self.channel_width}")
        if self.channel_width == 0 and self.d_model % self.n_channels:
            raise ConfigError(
                f"ESSHConfig.d_model={self.d_model} must be divisible by n_channels={self.n_channels}"
                " (value width P = d / K-bar)"
            )
        if self.d_model % self.head_dim:
            raise ConfigError(
                f"ESSHConfig.d_model={self.d_model} must be divisible by head_dim={self.head_dim}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ESSHConfig.head_dim={self.head_dim} must be even (RoPE)")
        bad = [i for i in self.swa_layers if not 0 <= i < self.n_layers]
        if bad or len(set(self.swa_layers)) != len(self.swa_layers):
            raise ConfigError(
                f"ESSHConfig.swa_layers={self.swa_layers}: indices must be distinct and in [0, {self.n_layers})"
            )
        if not self.tier_xi or any(not 0 < x <= 1 for x in self.tier_xi):
            raise ConfigError(f"ESSHConfig.tier_xi must be fractions in (0, 1], got {self.tier_xi}")
        if list(self.tier_xi) != sorted(self.tier_xi) or self.tier_xi[-1] != 1.0:
            raise ConfigError("ESSHConfig.tier_xi must be increasing and end with 1.0 (the full tier)")
        if self.n_modes > self.filter_length // 4:
            raise ConfigError("ESSHConfig.n_modes must be <= filter_length / 4 (matrix-pencil rank)")
        if not 0 < self.pole_clip < 1:
            raise ConfigError("ESSHConfig.pole_clip must lie in (0, 1)")
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not -1 <= v < self.vocab_size:
                raise ConfigError(f"ESSHConfig.{name}={v} must be -1 or a token id < vocab_size")

    @property
    def value_width(self) -> int:
        """P = d / K-bar, the per-channel value width (or the explicit ``channel_width``)."""
        return self.channel_width or self.d_model // self.n_channels

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    @property
    def layout(self) -> str:
        """Hybrid layout as a pattern string: 'S' spectral block, 'A' sliding-window attention block."""
        return "".join("A" if i in self.swa_layers else "S" for i in range(self.n_layers))

    @property
    def n_spectral_layers(self) -> int:
        return self.n_layers - len(self.swa_layers)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ESSHConfig:
        """A named shape; ``<name>-mixer`` is the mixer-only variant (no attention blocks, Tables 21-23)."""
        base, mixer_only = (name[:-6], True) if name.endswith("-mixer") else (name, False)
        if base not in ESSH_PRESETS:
            raise ConfigError(f"unknown ESSH preset {name!r}; choose one of {sorted(ESSH_PRESETS)}, or one of "
                              "them with '-mixer' for the mixer-only variant")
        return cls(**{**ESSH_PRESETS[base], **({"swa_layers": ()} if mixer_only else {}), **overrides})


#: ES-SSM presets. "tiny" (tests) and "small" (CPU) are ours. The paper-like byte LMs (ES-SSM Sec. 4-5:
#: K-bar = 32, budgets {2,...,32}, 2048-byte context) train with DropPath on both residual branches (Sec. 4.1);
#: its rate is not in the paper's text, 0.1 is our choice. "1.3b" is the paper's ~1.3B-parameter SlimPajama
#: byte LM (App. A); the paper's text gives no width or depth, so d = 1152 and 24 blocks are INFERRED: they
#: make the exact counter (``tier_table``) give 1.291B parameters at K = 32 (tied head, ffn_mult 4).
#: The ~330M byte replication and the ~50M LRA models (Sec. 5.2) have no stated shapes and no preset.
ESSSM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, n_layers=2, n_channels=8, seq_len=128, budgets=(2, 4, 8)),
    "small": dict(d_model=128, n_layers=4, n_channels=24, seq_len=512, budgets=(2, 3, 4, 5, 6, 8, 12, 16, 24)),
    "byte-base": dict(d_model=512, n_layers=8, n_channels=32, seq_len=2048, drop_path=0.1),
    "1.3b": dict(d_model=1152, n_layers=24, n_channels=32, seq_len=2048, drop_path=0.1),
}

ESSH_PRESETS: dict[str, dict[str, Any]] = {
    # Table 7, 370M column.
    "370m": dict(vocab_size=50304, d_model=896, n_layers=22, d_ff=4608, swa_layers=(12, 17, 21)),
    # Table 7, 1.5B column.
    "1.5b": dict(vocab_size=128256, d_model=2048, n_layers=28, d_ff=5632, swa_layers=(15, 22, 27)),
    # CPU presets (byte vocabulary 256 + 4 specials): "tiny" for tests, "small" for the quickstart.
    "tiny": dict(vocab_size=260, d_model=64, n_layers=3, d_ff=192, n_channels=8, n_modes=4,
                 swa_layers=(1,), window=16, head_dim=16, filter_length=256, ffn_align=16),
    "small": dict(vocab_size=260, d_model=192, n_layers=4, d_ff=512, n_channels=16, n_modes=8,
                  swa_layers=(2,), window=128, head_dim=32, filter_length=1024, ffn_align=32),
}


def model_configs() -> dict[str, type[ConfigBase]]:
    """Model config class of every ``model.arch``: the two papers' models and the baselines (E.6)."""
    from .baseline_config import MatFormerConfig, TransformerConfig

    return {c.arch: c for c in (ESSHConfig, ESSSMConfig, TransformerConfig, MatFormerConfig)}  # type: ignore


def model_config_from_dict(d: dict[str, Any]) -> ConfigBase:
    """Build a model config from ``{"arch": ..., "preset": optional name, "tier_config": optional tier,
    ...fields}``. ``arch`` is one of ``model_configs()`` (default "essh"). ``tier_config`` (e.g. "T4") gives
    the standalone configuration of that tier of the described model: an independent specialist trained
    from scratch at exactly the tier's shape (Table 43), whose parameter count equals the tier's."""
    if not isinstance(d, dict):
        raise ConfigError(f"model: expected a mapping such as {{arch: essh, preset: tiny}}, got {d!r}")
    d = dict(d)
    arch = d.pop("arch", "essh")
    configs = model_configs()
    if arch not in configs:
        raise ConfigError(f"model.arch must be one of {sorted(configs)}, got {arch!r}")
    cls = configs[arch]
    preset = d.pop("preset", None)
    tier = d.pop("tier_config", None)
    if preset is not None:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"model: unknown field(s) {unknown} beside preset {preset!r}; valid fields are "
                              f"{sorted(names)}")
        cfg = cls.preset(preset, **d)  # type: ignore[attr-defined]
    else:
        cfg = cls.from_dict(d)
    return cfg if tier in (None, "") else specialist_config(cfg, tier)


def specialist_config(cfg: ConfigBase, tier: Any) -> ConfigBase:
    """The standalone config of ``tier`` of ``cfg`` (what ``export_tier`` gives), to train from scratch."""
    from .elastic.tiers import resolve_tier
    from .models import model_class

    try:
        t = resolve_tier(cfg, tier)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.tier_config: {e}") from None
    small = model_class(cfg.arch).tier_config(cfg, t)  # type: ignore[attr-defined]
    # an ES-SSM export keeps the smaller budgets for budget dropout; a specialist trains its one budget only
    return small.replace(budgets=(small.n_channels,)) if isinstance(small, ESSSMConfig) else small


def load_any_config(path: str | Path) -> Any:
    """Load a YAML file of ``configs/``: a run file (``model:`` plus optional ``train:``/``data:``
    sections, loaded as a ``RunConfig``) or a bare model file (``arch:`` plus model fields)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping")
    if "model" in data:
        from .run_config import RunConfig

        return RunConfig.from_dict(data)
    return model_config_from_dict(data)
