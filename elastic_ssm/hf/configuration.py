"""``ESSHHFConfig``: a ``transformers`` config (model_type ``essh``) that reads our own ``config.json``.

Our ``save_pretrained`` writes ``config.json`` with ``model_type: essh``, ``architectures:
["ESSHForCausalLM"]``, ``vocab_size`` and the special-token ids beside our own keys (``config``: the
``ESSHConfig`` fields, ``tiers``: the tier table, ``tokenizer``: the tokenizer record; ``models/base.py``).
``AutoConfig.from_pretrained(dir)`` therefore builds this class directly from any of our model
directories, without a conversion step. ``tier`` (default None: the whole model) selects the tier that
``AutoModelForCausalLM.from_pretrained(dir, tier="T4")`` loads: lm-eval and ``pipeline`` pass such
keyword arguments through the config, so the tier lives here.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..config import ESSHConfig

__all__ = ["ESSHHFConfig"]


class ESSHHFConfig(PretrainedConfig):
    """The ``ESSHConfig`` of a model directory, its tier table and tokenizer ids, for ``transformers``.

    Attributes beyond ``PretrainedConfig``:
        config: the ``ESSHConfig`` fields (a dict, as in ``config.json``); ``essh_config()`` builds it.
        tiers: the tier table (list of dicts: name, K, n_ff, xi, params), as in ``config.json``.
        tier: the tier to load (``"T4"``, ``"K8"``; None or ``"full"``: the model as saved).
    """

    model_type = "essh"
    config: dict | None = None
    tiers: list | None = None
    tier: str | None = None
    arch: str = "essh"
    vocab_size: int = 260
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        if self.config is None:
            self.config = ESSHConfig.preset("tiny").to_dict()
        cfg = self.essh_config()
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.tie_word_embeddings = cfg.tie_embeddings
        if self.tiers is None:
            import dataclasses

            from ..elastic.tiers import tier_table

            self.tiers = [dataclasses.asdict(t) for t in tier_table(cfg)]
        if self.tier in ("", "full", "none"):
            self.tier = None
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):     # our configs use -1 for "none"
            if getattr(self, name) is not None and getattr(self, name) < 0:
                setattr(self, name, None)
        super().__post_init__(**kwargs)

    def essh_config(self) -> ESSHConfig:
        """The ``ESSHConfig`` this config describes (the saved model's, before any ``tier`` cut)."""
        return ESSHConfig.from_dict(dict(self.config))

    @classmethod
    def from_model(cls, model: Any, tier: str | None = None) -> ESSHHFConfig:
        """The config of a loaded ``ESSH`` (its own, possibly standalone, config and its tokenizer ids)."""
        meta = model._config_json()
        keep = {k: meta[k] for k in ("config", "tiers", "arch", "vocab_size", "bos_token_id", "eos_token_id",
                                     "pad_token_id", "format", "format_version", "source", "tokenizer")
                if k in meta}
        return cls(**keep, tier=tier, architectures=["ESSHForCausalLM"])
