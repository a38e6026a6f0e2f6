"""ES-SSM decode benchmark: ms per token of ``ESSSM.step`` per budget K, decoder and batch (``elastic-ssm bench
--bench.benchmarks es_ssm_decode``).

Protocol (as ``decode.py``): random weights at the ``es_ssm_preset`` shapes; the cache is allocated at
budget K with the chosen decoder (``exact``: ring buffers of the last L-1 inputs per block, ES-SSM Eq. 4
as one length-L dot product per retained channel and feature; ``modal``: ``es_ssm_modes`` damped-rotation
states per retained channel), its states filled with random values and its time index set to
``context`` (step cost does not depend on the cached values). ``warmup`` untimed steps, then ``iters``
steps timed one by one (CUDA events on the GPU); the median is reported in ms per step of the whole
batch. Weights bf16 on CUDA (float32 on CPU), filters and decode states float32. Eager only: the exact
decoder reads its ring at a host-side offset that changes every step, which a CUDA graph would freeze.

Suite kind ``es_ssm_report`` (``EsSsmReportOptions``, CPU, float32): for a trained ES-SSM byte LM directory
(e.g. the final model of ``elastic-ssm train --config configs/es-ssm-decode-cpu.yaml``), the filter-fit error and
the bits-per-byte change of the modal decoder against exact decoding on held-out windows of the embedded stdlib
corpus, through prefill + ``ESSSM.step`` (``eval/decode_bpb.py``), at each budget and m (docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigBase, ConfigError, ESSSMConfig, opt
from .decode import bench_decode

__all__ = ["EsSsmDecoder", "build_es_ssm", "es_ssm_decode_suite", "EsSsmReportOptions", "run_es_ssm_report"]


def build_es_ssm(cfg: ESSSMConfig, device: torch.device, dtype: torch.dtype):
    """A random ``ESSSM`` on ``device`` with parameters in ``dtype`` and the Hankel filters kept float32."""
    from ..models.es_ssm import ESSSM

    model = ESSSM(cfg).eval()
    with torch.no_grad():
        for b in model.blocks:  # random, non-trivial gates (the init's bias makes them all ~0.12)
            b.mixer.gate_out.bias.normal_()
    model = model.to(device=device, dtype=dtype)
    for b in model.blocks:
        b.mixer.filters = b.mixer.filters.float()
    return model


class EsSsmDecoder:
    """``ESSSM.step`` at budget K on a cache of ``batch`` sequences already ``context`` tokens in."""

    def __init__(self, model, K: int, batch: int, context: int, decode: str, n_modes: int) -> None:
        self.cache = model.allocate_cache(batch, K, decode=decode, n_modes=n_modes, state_dtype=torch.float32)
        with torch.no_grad():
            for s in self.cache.states.values():
                s.normal_(std=0.1)
        self.cache.position = context
        self.model, self.context = model, context

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.step(tokens, self.cache)

    def reset(self) -> None:
        """Back to ``context`` tokens (the states never run out of room)."""
        self.cache.position = self.context

    def state_bytes(self) -> dict[str, int]:
        return self.cache.nbytes()


def es_ssm_decode_suite(r, out: list) -> None:
    """Budgets x decoders x batches of ``r.cfg`` (a ``BenchConfig``) into ``out``, one row each."""
    cfg, dev = r.cfg, r.dev
    mcfg = ESSSMConfig.preset(cfg.es_ssm_preset)
    bad = [K for K in cfg.es_ssm_budgets if not 1 <= K <= mcfg.n_channels]
    if bad:
        raise ConfigError(f"BenchConfig.es_ssm_budgets: {bad} outside [1, {mcfg.n_channels}] of the"
                          f" {cfg.es_ssm_preset} preset")
    model = build_es_ssm(mcfg, dev, r.dtype)
    for K in cfg.es_ssm_budgets:
        for decode in cfg.es_ssm_decoders:
            m = cfg.es_ssm_modes if decode == "modal" else 0
            for B in cfg.es_ssm_batches:
                base = {"bench": "es_ssm_decode", "model": "es_ssm", "preset": cfg.es_ssm_preset, "K": K,
                        "decode": decode, "m": m or "-", "batch": B, "mode": "eager"}
                make = lambda b, g, K=K, decode=decode, m=m: EsSsmDecoder(model, K, b, cfg.context, decode,
                                                                          m or 8)
                fn = lambda make=make, B=B: bench_decode(make, B, False, cfg.warmup, cfg.iters,
                                                         mcfg.vocab_size, dev, cfg.sessions)
                r.run(out, base, fn)


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
    from ..data import evaluation_batches, load_corpus
    from ..eval.decode_bpb import format_modal_report, modal_report
    from ..models import load_pretrained

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
