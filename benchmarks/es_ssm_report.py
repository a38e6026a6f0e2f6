"""Suite kind ``es_ssm_report`` (``EsSsmReportOptions``, CPU, float32): for a trained ES-SSM byte LM directory
(e.g. the final model of ``elastic-ssm train --config configs/es-ssm-decode-cpu.yaml``), the filter-fit error and
the bits-per-byte change of the modal decoder against exact decoding on held-out windows of the embedded stdlib
corpus, through prefill + ``ESSSM.step`` (``elastic_ssm/eval/decode_bpb.py``), at each budget and m
(docs/results.md). The decode-speed benchmark of ES-SSM stays in the package (``elastic_ssm/bench/es_ssm_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["EsSsmReportOptions", "run_es_ssm_report"]


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
    """``eval.decode_bpb.modal_report`` rows; the markdown table also goes to ``report.md`` in the entry folder."""
    from elastic_ssm.data import evaluation_batches, load_corpus
    from elastic_ssm.eval.decode_bpb import format_modal_report, modal_report
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
