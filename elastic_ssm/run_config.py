"""A whole run in one YAML file: ``model`` (ESSH, ES-SSM or a baseline), ``train`` and ``data`` sections.

Example (``configs/quickstart.yaml``)::

    model: {arch: essh, preset: small}
    train: {steps: 300, micro_batch_size: 8, seq_len: 256}
    data:  {source: stdlib, tokenizer: bytes}

The CLI loads such a file, then applies ``--model.<field>``, ``--train.<field>``, ``--data.<field>``
overrides derived from the dataclasses (``cli_args.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigBase, ConfigError, ESSHConfig, model_config_from_dict, opt

__all__ = ["DataConfig", "ModelChoice", "RunConfig"]


@dataclass(kw_only=True)
class DataConfig(ConfigBase):
    """Where tokens come from (``elastic_ssm.data``)."""

    source: str = opt("stdlib", "'stdlib' (embedded default), a text/JSONL/Parquet file or folder, a prepared "
                                "*.bin token file, 'hf:<name>[:<config>][:<split>]', or a synthetic recall task "
                                "'synthetic:mqar[:num_pairs=16,...]' / 'synthetic:palindrome' (ESSH Appendix I)")
    val_source: str = opt("", "validation source ('' = the validation split of `source`)")
    tokenizer: str = opt("bytes", "'bytes', a tokenizer.json, or a tokenizer folder (tokenizer.json + "
                                  "tokenizer_config.json, e.g. a downloaded GPT-2 or Llama tokenizer); the "
                                  "model's vocab_size is taken from it and it is saved with every checkpoint")
    text_field: str = opt("text", "JSONL/Parquet/HF field holding the document text")
    max_train_bytes: int = opt(0, "cap on the in-memory training text in bytes (0 = no cap)")


@dataclass(kw_only=True)
class ModelChoice(ConfigBase):
    """Which model a run trains (the ``model`` section's keys beside the architecture's own fields)."""

    arch: str = opt("essh", "'essh', 'es_ssm', or a baseline of the ESSH paper (E.6): 'transformer' "
                            "(Transformer++), 'matformer' (nested FFN widths, N.1); with --model.preset")
    preset: str = opt("", "named shape of the arch: tiny, small, 370m, 1.5b (ESSH also '<name>-mixer': no "
                          "attention blocks, Tables 21-23; ES-SSM: tiny, small, byte-base)")
    tier_config: str = opt("", "train an independent specialist: the standalone shape of this tier of the "
                               "described model ('T4'; ES-SSM 'K8'), from scratch (Table 43)")


@dataclass(kw_only=True)
class RunConfig:
    """model + train + data; ``model`` is a config of ``config.model_configs()`` (``arch`` key in YAML)."""

    model: Any = field(default_factory=lambda: ESSHConfig.preset("small"))
    train: Any = None
    data: DataConfig = field(default_factory=DataConfig)
    #: model fields set explicitly (YAML ``model`` section or ``--model.<field>``), e.g. a padded vocab_size
    explicit_model_fields: frozenset = field(default_factory=frozenset, compare=False)
    #: the ``model`` section as written (arch, preset, tier_config and fields), for ``with_model_choice``
    model_source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        from .train.config import TrainConfig

        if self.train is None:
            self.train = TrainConfig()

    @property
    def arch(self) -> str:
        return type(self.model).arch

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        from .train.config import TrainConfig

        unknown = sorted(set(d) - {"model", "train", "data"})
        if unknown:
            raise ConfigError(f"run config: unknown section(s) {unknown}; use model, train, data")
        model = d.get("model") or {"arch": "essh", "preset": "small"}
        if not isinstance(model, dict):
            raise ConfigError(f"run config: the model section must be a mapping (e.g. model: {{preset: tiny}}), "
                              f"got {type(model).__name__} {model!r}")
        source = dict(model)
        return cls(model=model_config_from_dict(source), train=TrainConfig.from_dict(d.get("train") or {}),
                   data=DataConfig.from_dict(d.get("data") or {}),
                   explicit_model_fields=frozenset(source) - _CHOICE_KEYS, model_source=source)

    def with_model_choice(self, **choice: str) -> RunConfig:
        """A copy whose model section takes ``arch`` / ``preset`` / ``tier_config`` from ``choice`` (the CLI's
        ``--model.arch`` ...). When the arch changes, the section's own fields are dropped and the file's
        ``train.recipe`` becomes 'auto' (a recipe is arch-specific; ``--train.recipe`` still overrides it); so
        it does with a ``tier_config`` (a specialist trains densely)."""
        ModelChoice(**choice)                          # type checks with the field names in the message
        source = dict(self.model_source or {"arch": self.arch})
        train = self.train
        if choice.get("arch", source.get("arch", "essh")) != source.get("arch", "essh"):
            source = {k: source[k] for k in ("preset", "tier_config") if k in source}
            train = train.replace(recipe="auto")
        if choice.get("tier_config"):             # a specialist has one tier: nothing to mix ('auto' -> dense)
            train = train.replace(recipe="auto")
        source.update({k: v for k, v in choice.items()})
        source = {k: v for k, v in source.items() if v != "" or k not in _CHOICE_KEYS}
        return RunConfig(model=model_config_from_dict(source), train=train, data=self.data,
                         explicit_model_fields=frozenset(source) - _CHOICE_KEYS, model_source=source)

    def to_dict(self) -> dict[str, Any]:
        return {"model": {"arch": self.arch, **self.model.to_dict()}, "train": self.train.to_dict(),
                "data": self.data.to_dict()}

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"run config {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a YAML mapping with model/train/data sections")
        return cls.from_dict(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def with_overrides(self, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> RunConfig:
        """A copy with field overrides per section; a field the section's config lacks is a ConfigError."""
        for section, cfg, changes in (("model", self.model, model), ("train", self.train, train),
                                      ("data", self.data, data)):
            unknown = sorted(set(changes) - set(cfg.to_dict()))
            if unknown:
                raise ConfigError(f"--{section}.{unknown[0]}: {type(cfg).__name__} has no field(s) {unknown}"
                                  f" (this run's model arch is {self.arch!r})")
        return RunConfig(model=self.model.replace(**model) if model else self.model,
                         train=self.train.replace(**train) if train else self.train,
                         data=self.data.replace(**data) if data else self.data,
                         explicit_model_fields=self.explicit_model_fields | frozenset(model),
                         model_source={**self.model_source, **model})


_CHOICE_KEYS = frozenset({"arch", "preset", "tier_config"})
