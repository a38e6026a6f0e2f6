"""elastic_ssm: train-once, export-many elastic spectral state space models (ES-SSM and ESSH).

Heavy modules are imported lazily, so ``import elastic_ssm`` is fast and works without CUDA, triton or fla.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ConfigError, ESSHConfig, ESSSMConfig

__version__ = "0.1.0"

_LAZY = {
    "spectral": ("elastic_ssm.spectral", None),
    "ops": ("elastic_ssm.ops", None),
    "layers": ("elastic_ssm.layers", None),
    "elastic": ("elastic_ssm.elastic", None),
    "models": ("elastic_ssm.models", None),
    "train": ("elastic_ssm.train", None),
    "data": ("elastic_ssm.data", None),
    "eval": ("elastic_ssm.eval", None),
    "bench": ("elastic_ssm.bench", None),
    "ESSSM": ("elastic_ssm.models.es_ssm", "ESSSM"),
    "ESSH": ("elastic_ssm.models.essh", "ESSH"),
    "compile_model": ("elastic_ssm.models", "compile_model"),
    "Tier": ("elastic_ssm.elastic.tiers", "Tier"),
    "tier_table": ("elastic_ssm.elastic.tiers", "tier_table"),
    "export_tier": ("elastic_ssm.elastic.export", "export_tier"),
    "check_export": ("elastic_ssm.elastic.export", "check_export"),
    "BudgetSampler": ("elastic_ssm.elastic.budget", "BudgetSampler"),
    "serve": ("elastic_ssm.serve", None),
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
