"""elastic_ssm.models: ESSH, ES-SSM, the baselines (Transformer++, MatFormer), the inference cache and
``load_pretrained`` for any of them."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from ..config import TierLike
from .base import ElasticModel
from .compile import compile_model
from .model_dir import CheckpointError, read_model_meta

__all__ = ["CheckpointError", "ElasticModel", "load_pretrained", "model_class", "build_model", "compile_model",
           "read_model_meta", "saved_model_class"]


#: arch -> (submodule, class), imported on first use
_CLASSES = {"essh": ("essh", "ESSH"), "es_ssm": ("es_ssm", "ESSSM"), "transformer": ("baselines", "TransformerPP"),
            "matformer": ("baselines", "MatFormer")}


def model_class(arch: str) -> type[ElasticModel]:
    if not isinstance(arch, str) or arch not in _CLASSES:
        raise CheckpointError(f"unknown model arch {arch!r}; expected 'essh', 'es_ssm', 'transformer' or 'matformer'")
    module, name = _CLASSES[arch]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def build_model(config: Any, seed: int | None = None) -> ElasticModel:
    """A freshly initialised model for a model config (``ESSHConfig``, ``ESSSMConfig``, ``TransformerConfig``,
    ``MatFormerConfig``: the class named by the config's ``arch``). With ``seed`` the global torch RNG is
    seeded first, so a seed gives the same model (what ``train`` does with ``TrainConfig.seed``)."""
    arch = getattr(type(config), "arch", None)
    if not isinstance(arch, str):
        raise TypeError(f"build_model needs a model config (ESSHConfig, ESSSMConfig, TransformerConfig, "
                        f"MatFormerConfig), got {type(config).__name__}")
    if seed is not None:
        torch.manual_seed(seed)
    return model_class(arch)(config)


def load_pretrained(path: str | Path, tier: TierLike = None, **kw: Any) -> ElasticModel:
    """Load a directory written by ``save_pretrained`` (ESSH or ES-SSM); ``tier`` loads only that tier."""
    return saved_model_class(path).from_pretrained(path, tier=tier, **kw)


def saved_model_class(path: str | Path) -> type[ElasticModel]:
    """The model class of a directory written by ``save_pretrained`` (its ``config.json`` checked for shape by
    ``read_model_meta``: a missing, malformed or unknown record is a ``CheckpointError`` naming the file)."""
    arch = read_model_meta(path)["arch"]
    try:
        return model_class(arch)
    except CheckpointError as e:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {e}") from e
