"""Post-hoc elastification of a dense-trained ESSH (ESSH Appendix E.7, N.6; docs/baselines.md): ``calibrate`` ranks
FFN units by ``I_{l,h} = abar_{l,h}^2 ||W_down[:, h]||^2`` (a plain mean over the calibration tokens) and, with
``channel_order="energy"``, spectral channels by ``E_k = mean_t ||W_k^out z_k(t)||^2`` (both permutations leave the
full model unchanged); recipe ``posthoc`` draws one mask (Eq. 7 tiers) per micro-batch and trains
``CE(p_mask, y) + KL(p_parent || p_mask)`` (``posthoc_train_config``). The frozen parent rides on the student as
``model.__dict__["frozen_teacher"]`` (not a submodule: not trained, checkpointed or wrapped) for ``LossModule``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ..elastic.tiers import capacity_tier
from ..layers.ffn import unit_index
from .capacity_mixed import MicroPlan, Recipe, slot_rng
from .ffn_order import enable_tracking, order_ffn_units

__all__ = ["PosthocRecovery", "calibrate", "channel_energy", "permute_channels", "posthoc_train_config",
           "CHANNEL_TENSORS"]

#: ``(parameter name, channel dim)`` of the spectral mixer's channel-indexed tensors, permuted together by
#: ``permute_channels``: ``in_proj.weight`` [K (P + 3M), D] rows (P + 3M per channel, channel-major),
#: ``out_proj.weight`` [D, K P] columns (P per channel), the tables ``gate_bias`` [K, 3, M],
#: ``rho_raw, theta, kc, ks, a`` [K, M] and ``beta`` [K] along dim 0.
CHANNEL_TENSORS = (("in_proj.weight", 0), ("gate_bias", 0), ("out_proj.weight", 1), ("rho_raw", 0),
                   ("theta", 0), ("kc", 0), ("ks", 0), ("a", 0), ("beta", 0))
_POSTHOC_STREAM = 4


class PosthocRecovery(Recipe):
    """E.7 recovery: one uniformly drawn mask per slot; CE + forward KL from the frozen parent (coef 1)."""

    name = "posthoc"

    def __init__(self, model: nn.Module, cfg: Any) -> None:
        if model.__dict__.get("frozen_teacher") is None:
            raise ValueError("TrainConfig.recipe='posthoc' recovers a dense-trained parent under its frozen copy: "
                             "run `elastic-ssm recover PARENT --protocol posthoc` or elastic_ssm.train.recover."
                             "elastify, not `train` from scratch")
        self.masks = tuple(float(x) for x in cfg.mixing.capacities)
        self.tiers = [None if x == 1.0 else capacity_tier(model.config, x) for x in self.masks]
        self.seed = cfg.seed

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        teacher = model.__dict__["frozen_teacher"]
        teacher.to(next(model.parameters()).device).eval().requires_grad_(False)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "masks": list(self.masks), "seed": self.seed}

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        draws = slot_rng(self.seed, step, _POSTHOC_STREAM).integers(0, len(self.masks), size=n_global)
        return [MicroPlan(tier=self.tiers[int(i)], label=self.masks[int(i)], distill=("kl", 1.0))
                for i in draws]


def posthoc_train_config(cfg: Any, masks: tuple[float, ...] | None = None) -> Any:
    """``cfg`` set to the E.7 recovery: recipe ``posthoc``, 1% warm-up then constant lr 1e-4 (cosine floor =
    peak), the mask fractions as ``capacities`` (default: ``cfg.mixing.capacities``), no refinement stage."""
    return cfg.updated({"recipe": "posthoc", "optim.lr": 1e-4, "optim.warmup_frac": 0.01, "optim.min_lr_frac": 1.0,
                        "mixing.capacities": tuple(masks) if masks else cfg.mixing.capacities, "refine.steps": 0})


@torch.no_grad()
def channel_energy(mixer: nn.Module, u: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``E_k = mean_t ||W_k^out z_k(t)||^2`` [K] (float64) for the mixer input ``u`` [B, T, D]; ``W_k^out`` are the
    columns k P .. (k + 1) P of ``out_proj.weight`` [D, K P]."""
    from ..ops.spectral_scan import scan

    K = mixer.K
    v, write, read, clock = mixer._controls(u, K, valid)
    z, _ = scan(v, write, read, clock, mixer._modal(K), check_values=False)  # [B, T, K, P]
    return mixer.channel_energy(z, K)


@torch.no_grad()
def permute_channels(mixer: nn.Module, perm: torch.Tensor) -> None:
    """Reorder the channels of a ``SpectralMixer`` (new channel i = old channel perm[i]), moving the per-channel
    blocks of every ``CHANNEL_TENSORS`` entry; the full output is unchanged (order-free sum of Sec. 4.1)."""
    for name, dim in CHANNEL_TENSORS:
        p = mixer.get_parameter(name)
        per = p.shape[dim] // mixer.K                  # entries per channel along dim
        p.copy_(p.index_select(dim, unit_index(perm.to(p.device), per)))


@torch.no_grad()
def calibrate(model: nn.Module, batches: list[Any], channel_order: str = "original") -> dict[str, Any]:
    """Calibration ranking (step 1) of ``model`` in place on ``(input_ids, labels)`` batches; returns
    ``{"ffn": [perm per layer], "channels": [perm per spectral layer], "tokens": n}``."""
    if channel_order not in ("original", "energy"):
        raise ValueError(f"channel_order must be 'original' (E.7) or 'energy', got {channel_order!r}")
    if not batches:
        raise ValueError("calibration needs at least one batch")
    ffns = model.ffn_layers()
    mixers = [b.mixer for b in model.blocks if getattr(b, "kind", "") == "S"]
    energy = [torch.zeros(m.K, dtype=torch.float64) for m in mixers]

    def add(e, mod, args) -> None:       # args = (u, K, valid) of SpectralMixer.forward; returns None
        e.add_(channel_energy(mod, args[0], args[2] if len(args) > 2 else None))
    hooks = [m.register_forward_pre_hook(partial(add, e)) for m, e in zip(mixers, energy) if channel_order == "energy"]
    was_training = model.training
    model.train()                                   # activation statistics are gathered in training mode
    for f in ffns:
        f.act_sq, f.track_activations = None, True
    tokens = 0
    try:
        for i, batch in enumerate(batches):
            for f in ffns:                           # decay i/(i+1): the running value is the plain mean
                f.stat_decay = i / (i + 1)
            ids = batch[0].to(next(model.parameters()).device)
            model(ids)
            tokens += ids.numel()
    finally:
        for h in hooks:
            h.remove()
        enable_tracking(model, False)
        model.train(was_training)
    ffn_perms = order_ffn_units(model)
    ch_perms = []
    for m, e in zip(mixers, energy):
        perm = torch.argsort(e, descending=True, stable=True) if channel_order == "energy" else torch.arange(m.K)
        permute_channels(m, perm)
        ch_perms.append(perm)
    for f in ffns:
        f.act_sq = None
    return {"ffn": ffn_perms, "channels": ch_perms, "tokens": tokens}

