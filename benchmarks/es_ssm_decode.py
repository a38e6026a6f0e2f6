"""Suite kind ``es_ssm_decode`` (``EsSsmDecodeOptions``; the ``decode`` entry of the ``es-ssm`` suite): ms per
``ESSSM.step`` per budget K, decoder (``exact`` ring buffers, Eq. 4, or ``modal``) and batch, random weights at an
ES-SSM preset's shapes; eager only (the exact decoder reads its ring at a host-side offset that a CUDA graph would
freeze). Timed by ``elastic_ssm.bench.decode.bench_decode``, as the ESSH decode rows of ``elastic-ssm bench``."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Literal

import torch

from elastic_ssm.config import ConfigBase, ConfigError, ESSSMConfig, opt
from elastic_ssm.config.base import AtLeast1

__all__ = ["EsSsmDecodeOptions", "EsSsmDecoder", "build_es_ssm", "run_es_ssm_decode"]


@dataclass(kw_only=True)
class EsSsmDecodeOptions(ConfigBase):
    """Budgets x decoders x batches of an ES-SSM preset, and how each is timed."""

    preset: str = opt("byte-base", "ES-SSM preset whose shapes are decoded (random weights)")
    budgets: tuple[AtLeast1, ...] = opt((2, 8, 32), "budgets K, each at most the preset's channels")
    batches: tuple[AtLeast1, ...] = opt((1, 64), "batch sizes (eager)")
    decoders: tuple[Literal["exact", "modal"], ...] = opt(("exact", "modal"), "decoders, exact and/or modal")
    n_modes: AtLeast1 = opt(8, "modes m per channel of the modal decoder")
    context: int = opt(2048, "tokens already in the decode cache")
    warmup: int = opt(50, "untimed decode steps per session")
    iters: AtLeast1 = opt(200, "timed decode steps per session")
    sessions: AtLeast1 = opt(1, "timing sessions per row")
    dtype: Literal["auto", "bfloat16", "float32"] = opt("auto", "parameters' dtype: auto (bfloat16 on CUDA, float32 "
                                                        "on CPU), bfloat16, float32; the Hankel filters stay float32")
    device: str = opt("auto", "auto (cuda if available), cuda, cpu")
    seed: int = opt(0, "random seed of weights and tokens")


def build_es_ssm(cfg: ESSSMConfig, device: torch.device, dtype: torch.dtype):
    """A random ``ESSSM`` on ``device`` with parameters in ``dtype`` and the Hankel filters kept float32."""
    from elastic_ssm.models.es_ssm import ESSSM

    model = ESSSM(cfg).eval()
    with torch.no_grad():
        for b in model.blocks:  # random, non-trivial gates (the init's bias makes them all ~0.12)
            b.mixer.gate_out.bias.normal_()
    model = model.to(device=device, dtype=dtype)
    for b in model.blocks:
        b.mixer.filters = b.mixer.filters.float()
    return model


class EsSsmDecoder:
    """``ESSSM.step`` at budget K on a cache of ``batch`` sequences already ``context`` tokens in (random states)."""

    def __init__(self, model, K: int, batch: int, context: int, decode: str, n_modes: int) -> None:
        self.cache = model.allocate_cache(batch, K, decode=decode, n_modes=n_modes, state_dtype=torch.float32)
        with torch.no_grad():
            for s in self.cache.states.values():
                s.normal_(std=0.1)
        self.cache.position = context
        self.model, self.context = model, context

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of ``tokens`` [B]."""
        return self.model.step(tokens, self.cache)

    def reset(self) -> None:
        """Back to ``context`` tokens (the states never run out of room)."""
        self.cache.position = self.context

    def state_bytes(self) -> dict[str, int]:
        return self.cache.nbytes()


def run_es_ssm_decode(opts: EsSsmDecodeOptions, ctx) -> list[dict]:
    """A row per budget x decoder x batch: ``bench_decode``'s ms, tok/s and state bytes per sequence (an error, an
    OOM or a row after the suite's budget is the row's ``error``; the other rows still run)."""
    from elastic_ssm.bench.decode import bench_decode
    from elastic_ssm.cli_util import resolve_device, resolve_dtype

    torch.manual_seed(opts.seed)
    dev = torch.device(resolve_device(opts.device, "EsSsmDecodeOptions.device"))
    mcfg = ESSSMConfig.preset(opts.preset)
    bad = [K for K in opts.budgets if K > mcfg.n_channels]
    if bad:         # checked here, not by the options: --bench.set may change preset and budgets one after the other
        raise ConfigError(f"EsSsmDecodeOptions.budgets: {bad} outside [1, {mcfg.n_channels}] of the {opts.preset} "
                          "preset")
    model = build_es_ssm(mcfg, dev, resolve_dtype(opts.dtype, str(dev)))
    rows, t0 = [], time.monotonic()
    for K, decode, B in itertools.product(opts.budgets, opts.decoders, opts.batches):
        m = opts.n_modes if decode == "modal" else 0
        row = {"model": "es_ssm", "preset": opts.preset, "K": K, "decode": decode, "m": m or "-", "batch": B}
        make = lambda b, g, K=K, decode=decode, m=m: EsSsmDecoder(model, K, b, opts.context, decode, m or 8)
        if ctx.time_left() <= 0:
            row["error"] = "skipped: time budget"
        else:
            try:
                row.update(bench_decode(make, B, False, opts.warmup, opts.iters, mcfg.vocab_size, dev, opts.sessions))
            except Exception as e:  # one failing row must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(row)
        ctx.log(f"[{time.monotonic() - t0:6.1f}s] {row}")
    return rows
