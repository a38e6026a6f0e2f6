"""elastic_ssm: train-once, export-many elastic spectral state space models (ES-SSM and ESSH).

Heavy modules are imported lazily, so ``import elastic_ssm`` is fast and works without CUDA, triton or fla."""

from __future__ import annotations

import importlib
from typing import Any

from .config import ConfigError, ESSHConfig, ESSSMConfig

__version__ = "0.1.0"

#: name -> (module, attribute or None for the module itself), imported on first use
_LAZY = {
    **{sub: (f"elastic_ssm.{sub}", None) for sub in ("spectral", "ops", "layers", "elastic", "models", "train", "data",
                                                     "eval", "bench", "serve")},
    "ESSSM": ("elastic_ssm.models.es_ssm", "ESSSM"),
    "ESSH": ("elastic_ssm.models.essh", "ESSH"),
    "compile_model": ("elastic_ssm.models", "compile_model"),
    "Tier": ("elastic_ssm.elastic.tiers", "Tier"),
    "tier_table": ("elastic_ssm.elastic.tiers", "tier_table"),
    "export_tier": ("elastic_ssm.models", "export_tier"),
    "check_export": ("elastic_ssm.models", "check_export"),
    "BudgetSampler": ("elastic_ssm.train.recipes", "BudgetSampler"),
    "select_tier": ("elastic_ssm.serve.select", "select_tier"),
}

__all__ = ["ConfigError", "ESSHConfig", "ESSSMConfig", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'elastic_ssm' has no attribute {name!r}")
    module, attr = _LAZY[name]
    obj = importlib.import_module(module)
    if attr is not None:
        obj = getattr(obj, attr)
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(__all__)
