"""Truncate a trained ESSH and recover it (the paper's controls for models not trained with capacity mixing):
``truncate_and_recover`` evaluates every tier as cut, recovers by one protocol and evaluates again:
``"refine"`` (the dense control of Tables 33, 37, 43: shared refinement, D.8), ``"label_only"`` (Table 43: each tier
exported and trained at its shape with label CE) or ``"posthoc"`` (E.7, ``elastify``). CLI: ``elastic-ssm recover``."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..elastic.export import export_tier
from ..eval.perplexity import evaluate_tiers
from .loop import train
from .posthoc import calibrate, posthoc_train_config

__all__ = ["PROTOCOLS", "Recovery", "truncate_and_recover", "elastify"]

PROTOCOLS = ("refine", "label_only", "posthoc")


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
