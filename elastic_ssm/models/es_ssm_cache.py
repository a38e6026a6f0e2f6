"""Inference cache of an ES-SSM model at one budget K: per block the last L-1 inputs [B, L-1, D]
(``decode="exact"``) or modal states [B, K, M, 2, D] (``"modal"``), sized as ``elastic.tiers.state_bytes``.
``ESSSM.generate(decode=, n_modes=)`` reaches ``allocate_cache`` through ``cache_options``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import TierLike
from ..elastic.tiers import Tier
from ..layers.es_ssm_decode import DecodePlan, SpectralDecodeState, check_decode

__all__ = ["ESSSMCache", "cache_options"]

_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("es_ssm_cache_options", default=None)


@contextlib.contextmanager
def cache_options(**options: Any) -> Iterator[None]:
    """Within the block, ``ESSSMCache.allocate`` uses ``options`` (decode, n_modes) as its defaults."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


@dataclass
class ESSSMCache:
    """Decode state of ``batch`` sequences at ``tier`` (``tier.K`` retained channels)."""

    batch: int
    tier: Tier
    decode: str
    n_modes: int
    layers: dict[int, SpectralDecodeState] = field(default_factory=dict)   # block -> its sublayer's state

    @property
    def states(self) -> dict[int, torch.Tensor]:
        """block -> its buffer: exact [B, L-1, D] ring | modal [B, K, M, 2, D] mode states."""
        return {i: s.buffer for i, s in self.layers.items()}

    @property
    def plans(self) -> dict[int, DecodePlan]:
        """block -> the constants of its decoder."""
        return {i: s.plan for i, s in self.layers.items()}

    @property
    def position(self) -> int:
        """The next time index (the padded prompt length plus the steps taken), shared by every block."""
        return next(iter(self.layers.values())).t if self.layers else 0

    @position.setter
    def position(self, t: int) -> None:
        for s in self.layers.values():
            s.t = t

    @classmethod
    def allocate(cls, model, batch: int, tier: TierLike = None, *, decode: str | None = None,
                 n_modes: int | None = None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, **unknown: Any) -> ESSSMCache:
        """Zeroed cache. ``state_dtype`` defaults to float32 (float64 for a float64 model); ``kv_dtype`` is
        accepted for the generation contract and unused (ES-SSM keeps no keys or values)."""
        if unknown:
            raise ValueError(f"unknown ES-SSM cache option(s) {sorted(unknown)}; allocate_cache takes batch, tier,"
                             " decode ('exact' | 'modal'), n_modes and state_dtype")
        defaults = _OPTIONS.get() or {}
        decode = defaults.get("decode", "exact") if decode is None else decode
        n_modes = defaults.get("n_modes", 8) if n_modes is None else n_modes
        cfg = model.config
        if cfg.task != "lm":
            raise ValueError("cached decoding needs an ES-SSM language model (task='lm'); a classifier has"
                             " no next token")
        decode, n_modes = check_decode(decode, n_modes, cfg.seq_len)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        t = model.resolve_tier(tier)
        if state_dtype is None:
            state_dtype = torch.float64 if model.embed.weight.dtype == torch.float64 else torch.float32
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype must be a floating dtype, got {state_dtype}")
        cache = cls(batch=batch, tier=t, decode=decode, n_modes=n_modes)
        for i, block in enumerate(model.blocks):
            cache.layers[i] = block.mixer.init_state(batch, t, state_dtype=state_dtype, decode=decode, n_modes=n_modes)
        return cache

    def nbytes(self) -> dict[str, int]:
        """Per-cache state in bytes: ``recurrent`` (ring buffers or mode states), ``kv`` (0), ``total``."""
        rec = sum(s.numel() * s.element_size() for s in self.states.values())
        return {"recurrent": rec, "kv": 0, "total": rec}

    def fit_errors(self) -> torch.Tensor | None:
        """Modal mode: relative filter-fit errors [K] of block 0 (every block has the same filters unless a
        saved model says otherwise; ``plans[i].errors`` has each); exact mode: None."""
        return None if self.decode == "exact" else self.plans[0].errors

    def reset(self) -> None:
        """Empty the cache in place (zero states, time 0) for a new batch of prompts."""
        for s in self.layers.values():
            s.buffer.zero_()
        self.position = 0

    def check_prefill(self, K: int) -> None:
        """A prefill must target the cache's budget and an empty cache."""
        if K != self.tier.K:
            raise ValueError(f"this cache was built for budget K={self.tier.K} but the forward asks for K={K};"
                             f" allocate a cache with tier={K} (or run the forward with tier={self.tier.K})")
        if self.position:
            raise ValueError("forward(cache=...) prefills an empty cache; continue a cached sequence with step()"
                             " (or cache.reset() and prefill the whole prefix)")
