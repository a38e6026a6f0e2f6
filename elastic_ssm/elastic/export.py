"""Standalone tier export and the export check (ESSH Appendix D.2, D.8, Q.2; ES-SSM Appendix B.6): parameter
count against the config formula, and logits against the shared model at the tier (bitwise on CPU float32)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import TierLike
from ..eval.perplexity import eval_mode

__all__ = ["export_tier", "check_export", "ExportCheck"]


def export_tier(model: Any, tier: TierLike) -> Any:
    """A standalone model holding only ``tier``'s retained tensors, with its own smaller config."""
    from ..models.base import ElasticModel, export_state

    if not isinstance(model, ElasticModel):
        raise TypeError(f"export_tier needs an elastic_ssm model (ESSH, ESSSM, TransformerPP, MatFormer), got "
                        f"{type(model).__name__}; load a directory with es.models.load_pretrained first")
    t = model.resolve_tier(tier)
    with torch.device("meta"):
        small = type(model)(type(model).tier_config(model.config, t))
    device = next(model.parameters()).device
    small.load_tier_state({k: v.to(device) for k, v in export_state(model, t).items()})
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
