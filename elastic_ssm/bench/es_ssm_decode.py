"""ES-SSM decode: ms per ``ESSSM.step`` per budget K, decoder (``exact`` ring buffers, Eq. 4, or ``modal``) and
batch; eager only (the exact decoder reads its ring at a host-side offset that a CUDA graph would freeze)."""

from __future__ import annotations

import torch

from ..config import ConfigError, ESSSMConfig
from .decode import bench_decode

__all__ = ["EsSsmDecoder", "build_es_ssm", "es_ssm_decode_suite"]


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
