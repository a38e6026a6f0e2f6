"""elastic_ssm.models: ESSH, ES-SSM, the baselines (Transformer++, MatFormer), the inference cache and
``load_pretrained`` for any of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import TierLike
from .base import CheckpointError, ElasticModel
from .compile import compile_model

__all__ = ["CheckpointError", "ElasticModel", "load_pretrained", "model_class", "build_model", "compile_model"]


def model_class(arch: str) -> type[ElasticModel]:
    if arch == "essh":
        from .essh import ESSH

        return ESSH
    if arch == "es_ssm":
        from .es_ssm import ESSSM

        return ESSSM
    if arch in ("transformer", "matformer"):
        from .baselines import MatFormer, TransformerPP

        return TransformerPP if arch == "transformer" else MatFormer
    raise CheckpointError(f"unknown model arch {arch!r}; expected 'essh', 'es_ssm', 'transformer' or 'matformer'")


def build_model(config: Any, seed: int | None = None) -> ElasticModel:
    """A freshly initialised model for a model config (``ESSHConfig``, ``ESSSMConfig``, ``TransformerConfig``,
    ``MatFormerConfig``: the class named by the config's ``arch``). With ``seed`` the global torch RNG is
    seeded first, so a seed gives the same model (what ``train`` does with ``TrainConfig.seed``)."""
    arch = getattr(type(config), "arch", None)
    if not isinstance(arch, str):
        raise TypeError(f"build_model needs a model config (ESSHConfig, ESSSMConfig, TransformerConfig, "
                        f"MatFormerConfig), got {type(config).__name__}")
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    return model_class(arch)(config)


def saved_model_class(path: str | Path) -> type[ElasticModel]:
    """The model class of a directory written by ``save_pretrained`` (its ``config.json``'s ``arch``);
    ``CheckpointError`` naming the problem for a folder that holds no model or a corrupted config."""
    cfile = Path(path) / "config.json"
    if not cfile.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a directory written by save_pretrained "
                              "(a training run keeps its final model in <out_dir>/final)")
    try:
        arch = json.loads(cfile.read_text()).get("arch", "")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfile} is not valid JSON ({e}); the file is corrupted") from e
    return model_class(arch)


def load_pretrained(path: str | Path, tier: TierLike = None, **kw: Any) -> ElasticModel:
    """Load a directory written by ``save_pretrained`` (ESSH or ES-SSM); ``tier`` loads only that tier."""
    return saved_model_class(path).from_pretrained(path, tier=tier, **kw)
