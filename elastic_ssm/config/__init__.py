"""elastic_ssm.config: every configuration of the library as one torch-free tree of keyword-only dataclasses.

- ``base.py``: ``ConfigBase`` (help per field, validation by pydantic, YAML round trip),
  ``ConfigError``, ``opt``;
- ``model.py``: ``ModelConfig`` (what an architecture declares: tier table, exact counts, standalone and
  specialist configs, its recipes), ``Tier``, ``TierLike``, the registry ``model_configs()``;
- ``essh.py`` (``ESSHConfig``), ``es_ssm.py`` (``ESSSMConfig``), ``baselines.py`` (``TransformerConfig``,
  ``MatFormerConfig``): the architectures and their presets;
- ``recipe.py``: the sections of ``TrainConfig`` (optim, mixing, ordering, budget_dropout, eval, checkpoint,
  refine); ``train.py``: ``TrainConfig`` and its presets;
- ``run.py``: ``RunConfig`` (model + train + data), ``DataConfig``, ``ModelChoice``, ``load_any_config``.

Importing this package never imports torch (tested), so a run file can be read and checked anywhere.
"""

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
from .train import PARALLEL, PRECISIONS, RECIPES, TRAIN_PRESETS, TrainConfig, resolve_precision

__all__ = [
    "ConfigBase", "ConfigError", "opt",
    "ModelConfig", "FractionTierConfig", "Tier", "TierLike", "model_configs", "tier_word",
    "ESSHConfig", "ESSH_PRESETS", "ESSH_TIER_XI", "ESSSMConfig", "ESSSM_PRESETS", "ESSSM_BUDGETS",
    "TransformerConfig", "MatFormerConfig", "TRANSFORMER_PRESETS", "MATFORMER_GRANULARITIES",
    "TrainConfig", "RefineConfig", "OptimConfig", "MixingConfig", "OrderingConfig", "BudgetDropoutConfig",
    "EvalConfig", "CheckpointConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "TRAIN_PRESETS", "RECIPES",
    "PARALLEL", "PRECISIONS", "resolve_precision",
    "RunConfig", "DataConfig", "ModelChoice", "load_any_config", "model_config_from_dict", "specialist_config",
]
