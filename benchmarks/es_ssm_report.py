"""Suite kind ``es_ssm_report`` (``EsSsmReportOptions``, CPU, float32): for a trained ES-SSM byte LM directory
(e.g. the final model of ``elastic-ssm train --config configs/es-ssm-decode-cpu.yaml``), the filter-fit error and
the bits-per-byte change of the modal decoder against exact decoding on held-out windows of the embedded stdlib
corpus, through prefill + ``ESSSM.step`` (``decode_bpb`` below), at each budget and m
(docs/results.md). The decode-speed benchmark of ES-SSM is the ``es_ssm_decode`` kind (``es_ssm_decode.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from elastic_ssm.config import ConfigBase, ConfigError, TierLike, opt

__all__ = ["EsSsmReportOptions", "run_es_ssm_report", "decode_bpb", "modal_report", "format_modal_report"]


@dataclass(kw_only=True)
class EsSsmReportOptions(ConfigBase):
    """Modal vs exact ES-SSM decoding of a trained model: bits per byte and filter-fit error per budget and m."""

    model: str = opt("", "trained ES-SSM model directory (save_pretrained), e.g. runs/es-ssm-decode-cpu/final")
    windows: int = opt(32, "held-out windows of L tokens")
    budgets: tuple[int, ...] = opt((), "budgets K (empty: the model's budgets)")
    modes: tuple[int, ...] = opt((4, 8, 16), "m of the modal decoder")
    prefill: int = opt(1, "tokens prefilled before stepping")
    threads: int = opt(2, "torch CPU threads")

    def validate(self) -> None:
        if min(self.windows, self.prefill, self.threads, *self.modes, *self.budgets) < 1:
            raise ConfigError("EsSsmReportOptions: windows, prefill, threads, modes and budgets must be >= 1")


def run_es_ssm_report(opts: EsSsmReportOptions, ctx) -> list[dict]:
    """``modal_report`` rows; the markdown table also goes to ``report.md`` in the entry folder."""
    from elastic_ssm.data import evaluation_batches, load_corpus
    from elastic_ssm.models import load_pretrained

    if not opts.model:
        raise ConfigError("es_ssm_report: name the trained model, e.g. --bench.set model=runs/es-ssm-decode-cpu/final")
    torch.set_num_threads(opts.threads)
    model = load_pretrained(opts.model).eval()
    if getattr(type(model.config), "arch", None) != "es_ssm":
        raise ConfigError(f"es_ssm_report: {opts.model} is a {type(model).__name__} model, not an ES-SSM one; name an "
                          "ES-SSM run's final model (e.g. runs/es-ssm-decode-cpu/final)")
    L = model.config.seq_len
    held = load_corpus("stdlib", "bytes", split="validation")
    batch = next(iter(evaluation_batches(held, L, opts.windows, 1)))[0]  # [N, L], spread over the split
    rows = modal_report(model, batch, list(opts.budgets or model.config.budgets), list(opts.modes),
                        prefill=opts.prefill)
    ctx.write_text("report.md", f"model `{opts.model}`; {batch.shape[0]} held-out stdlib windows of {L} bytes\n\n"
                   + format_modal_report(rows) + "\n")
    return rows


# ---- bits per byte through cached decoding: the exact ring buffer against the modal decoder --------------------
# ``decode_bpb`` prefills the first ``prefill`` tokens of held-out windows [N, T] into an ``ESSSMCache``, feeds every
# later token with ``ESSSM.step`` (teacher forcing) and averages the next-token cross-entropy; ``modal_report`` runs
# it for the exact decoder and the modal decoder at each budget and m, with the filter-fit errors of the retained
# channels (ESSH App. B.7 epsilon_k^(m)): the numbers of docs/results.md.
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
