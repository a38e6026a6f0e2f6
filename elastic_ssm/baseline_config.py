"""Moved to ``elastic_ssm.config`` (``config/baselines.py``); this module keeps ``from
elastic_ssm.baseline_config import TransformerConfig`` (and the rest) working for code written against earlier
versions."""

from .config.baselines import MATFORMER_GRANULARITIES, TRANSFORMER_PRESETS, MatFormerConfig, TransformerConfig

__all__ = ["TransformerConfig", "MatFormerConfig", "TRANSFORMER_PRESETS", "MATFORMER_GRANULARITIES"]
