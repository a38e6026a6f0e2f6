"""elastic_ssm.config: every configuration of the library as one tree of keyword-only dataclasses (map:
docs/architecture.md). Importing it never imports torch (tested), so a run file can be read and checked anywhere."""

from .base import ConfigBase, ConfigError, opt
from .baselines import MATFORMER_GRANULARITIES, TRANSFORMER_PRESETS, MatFormerConfig, TransformerConfig
from .es_ssm import ESSSM_BUDGETS, ESSSM_PRESETS, ESSSMConfig
from .essh import ESSH_PRESETS, ESSH_TIER_XI, ESSHConfig
from .model import FractionTierConfig, ModelConfig, Tier, TierLike, model_configs, tier_word
from .recipe import (
    REFINE_CAPACITIES,
    TRAIN_CAPACITIES,
    BudgetDropoutConfig,
    CheckpointConfig,
    EvalConfig,
    MixingConfig,
    OptimConfig,
    OrderingConfig,
    RefineConfig,
)
from .run import DataConfig, ModelChoice, RunConfig, load_any_config, model_config_from_dict, specialist_config
from .train import TRAIN_PRESETS, TrainConfig, resolve_precision

__all__ = [
    "ConfigBase", "ConfigError", "opt",
    "ModelConfig", "FractionTierConfig", "Tier", "TierLike", "model_configs", "tier_word",
    "ESSHConfig", "ESSH_PRESETS", "ESSH_TIER_XI", "ESSSMConfig", "ESSSM_PRESETS", "ESSSM_BUDGETS",
    "TransformerConfig", "MatFormerConfig", "TRANSFORMER_PRESETS", "MATFORMER_GRANULARITIES",
    "TrainConfig", "RefineConfig", "OptimConfig", "MixingConfig", "OrderingConfig", "BudgetDropoutConfig",
    "EvalConfig", "CheckpointConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "TRAIN_PRESETS", "resolve_precision",
    "RunConfig", "DataConfig", "ModelChoice", "load_any_config", "model_config_from_dict", "specialist_config",
]
