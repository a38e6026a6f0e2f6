"""AdamW parameter groups and the learning-rate schedule (ESSH Table 7, Appendices E.2 and D.8).

Pretraining (E.2): no weight decay on ``rho_raw``, ``theta``, ``kc``, ``ks``, embeddings, normalisation weights,
biases (``gate_bias``, ``*.bias``) and the blend coefficients ``beta``; decay on the zero-lag table ``a`` and every
other tensor with >= 2 dims. Shared refinement (D.8): decay on every tensor with >= 2 dims, none on vectors.
Schedule: linear warm-up to the peak, then cosine to ``min_frac x peak`` (Table 7: 1%, 10%; D.8: 5%, zero)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["NO_DECAY_NAMES", "param_groups", "build_adamw", "WarmupCosine"]

#: Parameter leaf names excluded from weight decay during pretraining (E.2), besides embeddings,
#: normalisation parameters and biases, which are recognised by module type / name.
NO_DECAY_NAMES = frozenset({"rho_raw", "theta", "kc", "ks", "beta", "gate_bias"})


def _decays(module: nn.Module, leaf: str, p: torch.Tensor, policy: str) -> bool:
    """Whether parameter ``leaf`` of ``module`` is weight-decayed under ``policy``."""
    if policy == "refine":  # D.8, literally: every tensor with >= 2 dims (gate_bias [K, 3, M] included)
        return p.dim() >= 2
    if isinstance(module, (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "Norm" in type(module).__name__:
        return False
    return False if leaf in NO_DECAY_NAMES or leaf == "bias" or leaf.endswith("_bias") else p.dim() >= 2


def param_groups(model: nn.Module, weight_decay: float, policy: str = "pretrain") -> list[dict[str, Any]]:
    """The AdamW groups ``[{decay}, {no decay}]`` (each with its ``names``; empty ones dropped) of ``policy``
    ``"pretrain"`` (E.2) or ``"refine"`` (D.8); tied parameters once, frozen ones left out."""
    if policy not in ("pretrain", "refine"):
        raise ValueError(f"policy must be 'pretrain' or 'refine', got {policy!r}")
    seen: set[int] = set()
    groups: tuple[list, list] = ([], [])       # (name, parameter) pairs with decay, without
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups[not _decays(module, leaf, p, policy)].append((f"{mod_name}.{leaf}" if mod_name else leaf, p))
    return [{"params": [p for _, p in g], "names": [n for n, _ in g], "weight_decay": wd}
            for g, wd in zip(groups, (weight_decay, 0.0)) if g]


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, ...], weight_decay: float,
                eps: float = 1e-8, policy: str = "pretrain") -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (fp32 master weights: the model's own): fused when every parameter is on a GPU,
    else foreach (deterministic on CPU, as the bit-exact resume needs)."""
    groups = param_groups(model, weight_decay, policy)
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    kw: dict[str, Any] = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, **kw)


@dataclass(frozen=True)
class WarmupCosine:
    """lr(step) for 0-based steps: ``peak * (step + 1) / warmup`` while ``step < warmup``, then
    ``floor + (peak - floor) * (1 + cos(pi * s)) / 2`` with ``s = (step - warmup) / (total - warmup)`` and
    ``floor = min_frac * peak`` (the floor falls one step after the last: no step is wasted at lr 0)."""

    peak: float
    total: int
    warmup: int
    min_frac: float

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.warmup <= self.total or self.peak <= 0:
            raise ValueError(f"WarmupCosine needs total >= 1, 0 <= warmup <= total, peak > 0; got {self}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        floor = self.min_frac * self.peak
        s = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * s))

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "total": self.total, "warmup": self.warmup, "min_frac": self.min_frac}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume with a different schedule (the LR curve would silently change)."""
        if state != self.state_dict():
            raise ValueError(f"cannot resume: the checkpoint's LR schedule {state} differs from this run's "
                             f"{self.state_dict()}; use the same steps, lr, warmup_frac and min_lr_frac")
