"""elastic_ssm.models: ESSH, ES-SSM, the baselines (Transformer++, MatFormer), the inference cache and
``load_pretrained`` for any of them; the standalone tier export and the export check (ESSH Appendix D.2, D.8, Q.2;
ES-SSM Appendix B.6): parameter count against the config formula, and logits against the shared model at the tier
(bitwise on CPU float32)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TierLike
from ..eval.perplexity import eval_mode
from .base import ElasticModel, _load_strict, export_state
from .compile import compile_model
from .model_dir import CheckpointError, read_model_meta

__all__ = ["CheckpointError", "ElasticModel", "load_pretrained", "model_class", "build_model", "compile_model",
           "read_model_meta", "saved_model_class", "export_tier", "check_export", "ExportCheck"]


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


def export_tier(model: Any, tier: TierLike) -> Any:
    """A standalone model holding only ``tier``'s retained tensors, with its own smaller config."""
    if not isinstance(model, ElasticModel):
        raise TypeError(f"export_tier needs an elastic_ssm model (ESSH, ESSSM, TransformerPP, MatFormer), got "
                        f"{type(model).__name__}; load a directory with es.models.load_pretrained first")
    t = model.resolve_tier(tier)
    with torch.device("meta"):
        small = type(model)(type(model).tier_config(model.config, t))
    device = next(model.parameters()).device
    _load_strict(small, {k: v.to(device) for k, v in export_state(model, t).items()}, "state dict")
    small.source = {"tier": t.name, "parent_config": model.config.to_dict()}
    small.tokenizer, small.tokenizer_record = model.tokenizer, model.tokenizer_record   # the tokenizer travels
    return small.train(model.training)


@dataclass
class ExportCheck:
    """Result of comparing a standalone export with the shared model at the same tier."""

    tier: str
    params_expected: int
    params_actual: int
    max_abs_diff: float
    bitwise_equal: bool
    tolerance: float

    @property
    def ok(self) -> bool:
        params_ok = self.params_expected == self.params_actual
        return params_ok and (self.bitwise_equal or self.max_abs_diff <= self.tolerance)

    def __str__(self) -> str:
        status = "OK" if self.ok else "FAILED"
        eq = "bitwise equal" if self.bitwise_equal else f"max |diff| {self.max_abs_diff:.3g}"
        return f"{self.tier}: {status} params {self.params_actual:,} (config {self.params_expected:,}), logits {eq}"


@torch.no_grad()
def check_export(model: Any, tier: TierLike, input_ids: torch.Tensor | None = None, standalone: Any = None,
                 tolerance: float = 0.0, seq_len: int = 64, batch: int = 2, seed: int = 0) -> ExportCheck:
    """Compare ``standalone`` (default: a fresh ``export_tier``) with ``model(input_ids, tier=tier)`` (default
    ids [B, T]: seeded random tokens); ``tolerance`` 0 demands bitwise equality (the CPU float32 guarantee)."""
    t = model.resolve_tier(tier)
    if standalone is None:
        standalone = export_tier(model, t)
    if input_ids is None:
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    input_ids = input_ids.to(next(model.parameters()).device)
    with eval_mode(model, standalone):
        ref = model(input_ids, tier=t)
        out = standalone(input_ids)
    ref = ref.logits if hasattr(ref, "logits") else ref
    out = out.logits if hasattr(out, "logits") else out
    return ExportCheck(t.name, model.num_parameters(t), sum(p.numel() for p in standalone.parameters()),
                       (ref.float() - out.float()).abs().max().item(), bool(torch.equal(ref, out)), tolerance)
