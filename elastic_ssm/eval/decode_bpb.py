"""Bits per byte measured through cached decoding: the exact ring buffer against the modal decoder (ES-SSM).

``decode_bpb`` prefills the first ``prefill`` tokens of held-out windows [N, T] into an ``ESSSMCache``, feeds
every later token with ``ESSSM.step`` (teacher forcing) and averages the next-token cross-entropy;
``modal_report`` runs it for the exact decoder and the modal decoder at each budget and m, with the filter-fit
errors of the retained channels (ESSH App. B.7 epsilon_k^(m)): the numbers of ``docs/results.md``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..config import TierLike

__all__ = ["decode_bpb", "modal_report", "format_modal_report"]


@torch.no_grad()
def decode_bpb(model, windows: torch.Tensor, tier: TierLike = None, decode: str = "exact", n_modes: int = 8,
               prefill: int = 1, batch_size: int = 64, bytes_per_token: float = 1.0) -> dict[str, Any]:
    """Teacher-forced bits per byte of ``windows`` [N, T] through prefill + ``step``.

    Returns ``{"bpb", "tokens", "fit_errors"}``; ``fit_errors`` [K] is None for ``decode='exact'``.
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T] token ids with T >= 2, got {tuple(windows.shape)}")
    T = windows.shape[1]
    if not 1 <= prefill < T:
        raise ValueError(f"prefill={prefill} must lie in [1, T-1 = {T - 1}]: at least one token is stepped")
    model.eval()
    nll, count, errors = 0.0, 0, None
    for rows in windows.split(batch_size):
        cache = model.allocate_cache(rows.shape[0], tier, decode=decode, n_modes=n_modes)
        errors = cache.fit_errors()
        logits = [model(rows[:, :prefill], tier=tier, cache=cache)[:, -1]]  # [B, V]
        for t in range(prefill, T - 1):
            logits.append(model.step(rows[:, t], cache))
        lg = torch.stack(logits, dim=1).double()  # [B, T - prefill, V]
        target = rows[:, prefill:]  # [B, T - prefill]
        nll += float(F.cross_entropy(lg.flatten(0, 1), target.flatten(), reduction="sum"))
        count += target.numel()
    bpb = nll / count / math.log(2) / bytes_per_token
    return {"bpb": bpb, "tokens": count, "fit_errors": None if errors is None else errors.tolist()}


def modal_report(model, windows: torch.Tensor, budgets: Iterable[int], n_modes: Iterable[int] = (4, 8, 16),
                 **kw: Any) -> list[dict[str, Any]]:
    """One row per budget K and decoder: exact, then modal at each m, with ``bpb``, ``delta_bpb`` (modal
    minus exact at the same K), ``fit_max`` / ``fit_mean`` (relative filter-fit errors over channels 1..K)
    and the fp32 state bytes per sequence (``elastic.tiers.state_bytes``)."""
    from ..elastic.tiers import state_bytes

    rows = []
    for K in budgets:
        exact = decode_bpb(model, windows, K, "exact", **kw)
        sb = state_bytes(model.config, K, decode="exact")["total"]
        rows.append({"K": K, "decode": "exact", "m": "-", "bpb": exact["bpb"], "delta_bpb": 0.0,
                     "fit_max": 0.0, "fit_mean": 0.0, "state_bytes": sb, "tokens": exact["tokens"]})
        for m in n_modes:
            r = decode_bpb(model, windows, K, "modal", m, **kw)
            err = r["fit_errors"]
            rows.append({"K": K, "decode": "modal", "m": m, "bpb": r["bpb"], "delta_bpb": r["bpb"] - exact["bpb"],
                         "fit_max": max(err), "fit_mean": sum(err) / len(err),
                         "state_bytes": state_bytes(model.config, K, decode="modal", n_modes=m)["total"],
                         "tokens": r["tokens"]})
    return rows


def format_modal_report(rows: list[dict[str, Any]]) -> str:
    """``modal_report`` rows as a markdown table."""
    head = "| K | decode | m | fit error max | fit error mean | bpb | Δ bpb vs exact | state bytes/seq |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        fit = ("-", "-") if r["decode"] == "exact" else (f"{r['fit_max']:.3g}", f"{r['fit_mean']:.3g}")
        lines.append(f"| {r['K']} | {r['decode']} | {r['m']} | {fit[0]} | {fit[1]} | {r['bpb']:.5f} | "
                     f"{r['delta_bpb']:+.1e} | {r['state_bytes']:,} |")
    return "\n".join(lines)
