"""Truncate a trained ESSH and recover it (the paper's controls for models not trained with capacity mixing; CLI
``elastic-ssm recover``): ``truncate_and_recover`` evaluates every tier as cut, recovers by ``"refine"`` (Tables 33,
37, 43; D.8), ``"label_only"`` (Table 43) or ``"posthoc"`` (E.7, N.6: ``calibrate``, then ``elastify``) and evaluates
again; each protocol and its rankings: docs/baselines.md, "Truncate and recover" and "Post-hoc elastification".
The frozen parent rides on the student as ``model.__dict__["frozen_teacher"]``: not a submodule, so not trained,
checkpointed or wrapped."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..eval.perplexity import evaluate_tiers
from ..layers.ffn import unit_index
from ..models import export_tier
from .capacity_mixed import enable_tracking, order_ffn_units
from .loop import train

__all__ = ["PROTOCOLS", "Recovery", "truncate_and_recover", "elastify", "calibrate", "channel_energy",
           "permute_channels", "posthoc_train_config", "CHANNEL_TENSORS"]

PROTOCOLS = ("refine", "label_only", "posthoc")

#: ``(parameter name, channel dim)`` of the spectral mixer's channel-indexed tensors, permuted together by
#: ``permute_channels``: ``in_proj.weight`` [K (P + 3M), D] rows (P + 3M per channel, channel-major),
#: ``out_proj.weight`` [D, K P] columns (P per channel), the tables ``gate_bias`` [K, 3, M],
#: ``rho_raw, theta, kc, ks, a`` [K, M] and ``beta`` [K] along dim 0.
CHANNEL_TENSORS = (("in_proj.weight", 0), ("gate_bias", 0), ("out_proj.weight", 1), ("rho_raw", 0),
                   ("theta", 0), ("kc", 0), ("ks", 0), ("a", 0), ("beta", 0))


@dataclass
class Recovery:
    """Per-tier evaluations (``eval.perplexity.TierEval``) before and after recovery; ``model`` is the recovered
    shared model (``label_only``: the input model, its recovered exports are in ``exports``)."""

    protocol: str
    truncated: list[Any]
    recovered: list[Any]
    model: nn.Module
    exports: dict[str, nn.Module] = field(default_factory=dict)
    results: list[Any] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """One row per tier: params, loss / bits per byte truncated and recovered (the quickstart's table)."""
        return [{"tier": a.tier, "params": a.params, "loss_truncated": a.loss, "loss_recovered": b.loss,
                 "bpb_truncated": a.bpb, "bpb_recovered": b.bpb} for a, b in zip(self.truncated, self.recovered)]


def truncate_and_recover(model: nn.Module, data: Any, cfg: Any, val_batches: list[Any], protocol: str = "refine",
                         tiers: list[Any] | None = None, bytes_per_token: float = 1.0,
                         calibration: list[Any] | None = None, masks: tuple[float, ...] | None = None,
                         channel_order: str = "original", **train_kw: Any) -> Recovery:
    """Evaluate ``model`` at ``tiers`` (default: all), recover it by ``protocol`` on ``data`` (``cfg.out_dir``,
    ``cfg.refine.steps`` long; posthoc: ``calibration`` batches and ``masks``), evaluate again."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if cfg.refine.steps < 1:
        raise ValueError("recovery length is TrainConfig.refine.steps; set it >= 1 (the paper: 2060 steps for "
                         "refinement and post-hoc-matched runs, 4120 for label-only)")
    names = [model.resolve_tier(t) for t in (tiers if tiers is not None else model.tier_table())]
    truncated = evaluate_tiers(model, val_batches, names, bytes_per_token=bytes_per_token)
    if protocol == "posthoc" and not calibration:
        raise ValueError("protocol 'posthoc' needs calibration batches (E.7: a 2M-token calibration subset)")
    if protocol in ("refine", "posthoc"):
        res = train(model, data, cfg, val_data=val_batches, stages=("refine",), **train_kw) if protocol == "refine" \
            else elastify(model, data, cfg.replace(steps=cfg.refine.steps), calibration, val_data=val_batches,
                          masks=masks, channel_order=channel_order, **train_kw)
        recovered = evaluate_tiers(res.model, val_batches, names, bytes_per_token=bytes_per_token)
        return Recovery(protocol, truncated, recovered, res.model, results=[res])
    exports, results, recovered = {}, [], []
    record = train_kw.pop("record", None)
    for t in names:                  # label-only: each tier at its fixed shape, CE only (Table 43)
        small = export_tier(model, t)
        run = cfg.updated({"recipe": "dense", "steps": cfg.refine.steps, "optim.lr": cfg.refine.lr, "refine.steps": 0,
                           "out_dir": str(Path(cfg.out_dir) / t.name), "eval.tiers": ()})
        rec = None if record is None else {**record, "model": small.config.to_dict(), "train": run.to_dict()}
        res = train(small, data, run, val_data=val_batches, record=rec, **train_kw)
        ev = evaluate_tiers(res.model, val_batches, bytes_per_token=bytes_per_token)[0]
        recovered.append(dataclasses.replace(ev, tier=t.name, K=t.K, n_ff=t.n_ff, params=t.params))
        exports[t.name], results = res.model, [*results, res]
    return Recovery(protocol, truncated, recovered, model, exports, results)


def elastify(parent: nn.Module, data: Any, cfg: Any, calibration: list[Any], val_data: Any = None,
             masks: tuple[float, ...] | None = None, channel_order: str = "original", **train_kw: Any):
    """Post-hoc elastification of the dense-trained ESSH ``parent`` (E.7): calibrate a copy on ``calibration``,
    then recover it under the frozen ``parent`` with ``train()`` (``posthoc_train_config``); returns the
    ``TrainResult`` (its ``model`` the elastified student, ``calibration`` the permutations)."""
    if not hasattr(parent, "ffn_layers") or not hasattr(parent, "blocks"):
        raise TypeError(f"elastify needs an ESSH parent, got {type(parent).__name__}")
    student = copy.deepcopy(parent)
    student.source = {"posthoc_parent": getattr(parent, "name_or_path", "") or "in memory"}
    ranking = calibrate(student, calibration, channel_order)
    teacher = copy.deepcopy(parent).eval().requires_grad_(False)
    student.__dict__["frozen_teacher"] = teacher
    try:
        result = train(student, data, posthoc_train_config(cfg, masks), val_data=val_data, **train_kw)
    finally:
        student.__dict__.pop("frozen_teacher", None)
    result.calibration = ranking
    return result


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

