"""A whole run in one YAML file: ``model`` (``arch`` picks the class of ``model_configs()``), ``train`` and ``data``
sections (``configs/quickstart.yaml``); the CLI applies ``--model.<field>``, ``--train.<section>.<field>`` and
``--data.<field>`` overrides. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import ConfigBase, ConfigError, NonBlank, NonNeg, opt, read_yaml_file, read_yaml_mapping, section
from .essh import ESSHConfig
from .model import ModelConfig, TierLike, model_configs, tier_word
from .train import TrainConfig

__all__ = ["DEFAULT_RUN", "DataConfig", "ModelChoice", "RunConfig", "model_config_from_dict", "specialist_config",
           "load_any_config"]

_CHOICE_KEYS = frozenset({"arch", "preset", "tier_config"})
#: the run file of ``quickstart``, and of ``train`` / ``recover`` without ``--config``
DEFAULT_RUN = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@dataclass(kw_only=True)
class DataConfig(ConfigBase):
    """Where tokens come from (``elastic_ssm.data``)."""

    source: NonBlank = opt("stdlib", "'stdlib' (embedded default), a text/JSONL/Parquet file or folder, a prepared "
                                "*.bin token file, 'hf:<name>[:<config>][:<split>]', or a synthetic recall task "
                                "'synthetic:mqar[:num_pairs=16,...]' / 'synthetic:palindrome' (ESSH Appendix I)")
    val_source: str = opt("", "validation source, read whole ('' = the validation split of `source`; a named corpus or "
                          "prepared folder: its validation split)")
    tokenizer: NonBlank = opt("bytes", "'bytes', a tokenizer.json, or a tokenizer folder (tokenizer.json + "
                                  "tokenizer_config.json, e.g. a downloaded GPT-2 or Llama tokenizer); the "
                                  "model's vocab_size is taken from it and it is saved with every checkpoint")
    text_field: NonBlank = opt("text", "JSONL/Parquet/HF field holding the document text")
    max_train_bytes: NonNeg = opt(0, "cap on the in-memory training text in bytes (0 = no cap)")


@dataclass(kw_only=True)
class ModelChoice(ConfigBase):
    """Which model a run trains (the ``model`` section's keys beside the architecture's own fields)."""

    arch: str = opt("essh", "'essh', 'es_ssm', or a baseline of the ESSH paper (E.6): 'transformer' "
                            "(Transformer++), 'matformer' (nested FFN widths, N.1); with --model.preset")
    preset: str = opt("", "named shape of the arch: tiny, small, 370m, 1.5b (ESSH also '<name>-mixer': no "
                          "attention blocks, Tables 21-23; ES-SSM: tiny, small, byte-base)")
    tier_config: str = opt("", "train an independent specialist: the standalone shape of this tier of the "
                               "described model ('T4'; ES-SSM 'K8' or a budget 8), from scratch (Table 43)")


def specialist_config(cfg: ModelConfig, tier: TierLike) -> ModelConfig:
    """The config of an independent model of ``tier``'s shape of ``cfg``, to train from scratch (Table 43);
    ``tier`` as a string is a command-line word (``tier_word``)."""
    try:
        t = cfg.resolve_tier(tier_word(tier))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.tier_config: {e}") from None
    return cfg.specialist_config(t)


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A model config from ``{"arch": ... (default "essh"), "preset": optional, "tier_config": optional, ...fields}``;
    ``tier_config`` (e.g. "T4") gives that tier's specialist (``specialist_config``)."""
    if not isinstance(d, dict):
        raise ConfigError(f"model: expected a mapping such as {{arch: essh, preset: tiny}}, got {d!r}")
    d = dict(d)
    ModelChoice.from_dict({k: v for k, v in d.items() if k in _CHOICE_KEYS and v is not None})   # names: strings
    arch = d.pop("arch", "essh")
    configs = model_configs()
    if arch not in configs:
        raise ConfigError(f"model.arch must be one of {sorted(configs)}, got {arch!r}")
    if d.get("preset") is None:
        d.pop("preset", None)
    tier = d.pop("tier_config", None)
    cfg = configs[arch].from_dict(d)
    return cfg if tier in (None, "") else specialist_config(cfg, tier)


@dataclass(kw_only=True)
class RunConfig(ConfigBase):
    """model + train + data; ``model`` is a config of ``model_configs()`` (``arch`` key in YAML)."""

    model: ModelConfig = field(default_factory=lambda: ESSHConfig.preset("small"),
                               metadata={"help": "the model: {arch, preset, tier_config, ...fields}"})
    train: TrainConfig = section(TrainConfig, "training: recipe, batch, optimizer and recipe sections")
    data: DataConfig = section(DataConfig, "where tokens come from")
    model_source: dict = field(default_factory=dict, compare=False,
                               metadata={"help": "the model section as written (arch, preset, tier_config, "
                                                 "fields) and the --model.<field> flags, for with_model_choice"})

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model_source = self.model_source or dict(self.model)
            self.model = model_config_from_dict(self.model_source)
        super().__post_init__()

    @property
    def arch(self) -> str:
        return type(self.model).arch

    @property
    def explicit_model_fields(self) -> frozenset[str]:
        """The model fields set explicitly (the YAML model section or --model.<field>), e.g. a padded vocab_size that
        the tokenizer must not replace."""
        return frozenset(self.model_source) - _CHOICE_KEYS

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"run config: expected a mapping with model/train/data sections, got {d!r}"[:300])
        unknown = sorted(set(d) - {"model", "train", "data"}, key=str)
        if unknown:
            raise ConfigError(f"run config: unknown section(s) {unknown}; use model, train, data")
        return cls(model=d.get("model") or {"arch": "essh", "preset": "small"},   # not a mapping: RunConfig.model
                   train=TrainConfig.from_dict(d.get("train") or {}),
                   data=DataConfig.from_dict(d.get("data") or {}))

    def with_model_choice(self, **choice: str) -> RunConfig:
        """A copy whose model section takes ``arch`` / ``preset`` / ``tier_config`` from ``choice`` (``--model.arch``
        ...); another arch drops the section's own fields, and it or a ``tier_config`` sets ``train.recipe`` 'auto'."""
        ModelChoice(**choice)                          # type checks with the field names in the message
        source = dict(self.model_source or {"arch": self.arch})
        train = self.train
        if choice.get("arch", source.get("arch", "essh")) != source.get("arch", "essh"):
            source = {k: source[k] for k in ("preset", "tier_config") if k in source}
            train = train.replace(recipe="auto")
        if choice.get("tier_config"):             # a specialist has one tier: nothing to mix ('auto' -> dense)
            train = train.replace(recipe="auto")
        source.update(choice)
        source = {k: v for k, v in source.items() if v != "" or k not in _CHOICE_KEYS}
        return RunConfig(model=source, train=train, data=self.data)

    def to_dict(self) -> dict[str, Any]:
        return {"model": {"arch": self.arch, **self.model.to_dict()}, "train": self.train.to_dict(),
                "data": self.data.to_dict()}

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        """A run file; a missing or empty one (only comments), YAML syntax errors, a key given twice and a
        document that is not a mapping are ``ConfigError``s naming the file."""
        data = read_yaml_file(path, "run config")
        if data is None:
            raise ConfigError(f"run config {path} is empty; give model/train/data sections (e.g. model: {{preset: "
                              "tiny}) or leave out --config for the default run")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def with_overrides(self, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> RunConfig:
        """A copy with field overrides per section (``train`` keys may be dotted: ``optim.lr``); a field the
        section's config lacks is a ConfigError."""
        return dataclasses.replace(
            self, model=self.model.updated(model, "--model."), train=self.train.updated(train, "--train."),
            data=self.data.updated(data, "--data."), model_source={**self.model_source, **model})


def load_any_config(path: str | Path) -> RunConfig | ModelConfig:
    """Load a YAML file of ``configs/``: a run file (``model:`` plus optional ``train:``/``data:``
    sections, loaded as a ``RunConfig``) or a bare model file (``arch:`` plus model fields)."""
    data = read_yaml_mapping(Path(path), str(path))
    return RunConfig.from_dict(data) if "model" in data else model_config_from_dict(data)
