"""Inference caches at one tier: one state per layer, each the layer's own ``init_state``.

``ESSHCache``: spectral layers hold mode states [B, K_T, M, 2, P] (float32 by default, ESSH Sec. 4.3), attention
layers a ``RingState`` [B, H, W, hd] (bfloat16 on CUDA, Table 53); ``positions`` [B] is shared by every ring. Every
tensor stays at a fixed address (in-place writes), so a step can be captured in a CUDA graph.
``ESSSMCache`` (budget K): per block the last L-1 inputs [B, L-1, D] (``decode="exact"``) or modal states
[B, K, M, 2, D] (``"modal"``), sized as ``elastic.tiers.state_bytes``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import TierLike
from ..elastic.tiers import Tier, check_counts
from ..layers.attention import RingState
from ..layers.es_ssm import DecodePlan, SpectralDecodeState, check_decode
from ..utils.environment import checked_device

__all__ = ["ESSHCache", "ESSSMCache", "check_cache", "check_cache_dtype"]


def check_cache_dtype(name: str, dtype: Any) -> None:
    """``state_dtype`` / ``kv_dtype``: None or a floating ``torch.dtype`` of 2 bytes or more (an integer KV ring
    truncated keys and values to integers: every logit after the prefill was silently wrong)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1):
        raise TypeError(f"{name} must be None (the default) or a floating torch.dtype (torch.float32, torch.bfloat16, "
                        f"...), got {dtype!r}")


def check_cache(cache: Any, kind: type, batch: int | None = None, tier: Tier | None = None) -> None:
    """A ``forward(cache=)`` / ``step`` cache: a ``kind`` built for ``batch`` sequences at ``tier`` (the same
    channels and FFN units: a prefill at another tier filled states of another shape or mixed two models)."""
    if not isinstance(cache, kind):
        raise TypeError(f"cache must be the {kind.__name__} of model.allocate_cache(batch, tier), got "
                        f"{type(cache).__name__}")
    if batch is not None and cache.batch != batch:
        raise ValueError(f"this cache holds batch={cache.batch} sequences, input_ids has {batch}; "
                         f"allocate_cache({batch}, ...)")
    if tier is not None and (tier.K, tier.n_ff) != (cache.tier.K, cache.tier.n_ff):
        raise ValueError(f"this cache was built for tier {cache.tier.name} (K={cache.tier.K}) but the forward runs at "
                         f"{tier.name} (K={tier.K}); allocate a cache with tier={tier.name!r} (or run the forward with "
                         f"tier={cache.tier.name!r})")


def _state_dtype(model, batch: Any, state_dtype: torch.dtype | None, kv_dtype: Any = None) -> torch.dtype:
    """Checks ``batch`` (an int >= 1) and both dtypes, and gives the state dtype: ``state_dtype``, else float32
    (float64 for a float64 model)."""
    check_counts(batch=batch)
    check_cache_dtype("state_dtype", state_dtype)
    check_cache_dtype("kv_dtype", kv_dtype)
    if state_dtype is None:
        return torch.float64 if model.embed.weight.dtype == torch.float64 else torch.float32
    return state_dtype


def _nbytes(states: Any, kv: int = 0) -> dict[str, int]:
    rec = sum(s.numel() * s.element_size() for s in states)
    return {"recurrent": rec, "kv": kv, "total": rec + kv}


@dataclass
class ESSHCache:
    batch: int
    tier: Tier
    layers: list = field(default_factory=list)     # per layer: mode state [B,K,M,2,P] or RingState
    positions: torch.Tensor | None = None           # [B] int64

    @classmethod
    def allocate(cls, model, batch: int, tier=None, device=None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> ESSHCache:
        """Zeroed cache for ``batch`` sequences at ``tier``. Defaults: fp32 mode states (float64 for a
        float64 model), a bf16 KV ring on CUDA and the parameter dtype on CPU."""
        state_dtype = _state_dtype(model, batch, state_dtype, kv_dtype)
        t = model.resolve_tier(tier)
        param = model.embed.weight
        device = param.device if device is None else torch.device("meta") if str(device) == "meta" else \
            checked_device(device, "allocate_cache(device=)")   # meta: shapes and bytes only (benchmarks/memory.py)
        if kv_dtype is None:
            kv_dtype = torch.bfloat16 if device.type == "cuda" else param.dtype
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        layers = [b.mixer.init_state(batch, t, state_dtype=state_dtype, kv_dtype=kv_dtype, device=device,
                                     positions=positions) for b in model.blocks]
        return cls(batch=batch, tier=t, layers=layers, positions=positions)

    # ---- views by kind (for tests, benchmarks and memory accounting) ------------------------------------
    @property
    def states(self) -> dict[int, torch.Tensor]:
        """layer -> mode state [B, K, M, 2, P] of every spectral layer."""
        return {i: s for i, s in enumerate(self.layers) if isinstance(s, torch.Tensor)}

    @property
    def rings(self) -> dict[int, RingState]:
        """layer -> window ring of every attention layer."""
        return {i: s for i, s in enumerate(self.layers) if isinstance(s, RingState)}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (states, rings, slot positions, positions), for snapshots."""
        out = []
        for s in self.layers:
            out += [s] if isinstance(s, torch.Tensor) else [s.keys, s.values, s.slot_pos]
        return [*out, self.positions]

    def nbytes(self) -> dict[str, int]:
        return _nbytes(self.states.values(), sum(r.nbytes() for r in self.rings.values()))

    # ---- in-place reuse ------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_(self) -> ESSHCache:
        """Empty every sequence in place (zero states and rings, no slot filled, position 0)."""
        for t in self.tensors():
            t.zero_()
        for r in self.rings.values():
            r.slot_pos.fill_(-1)
        return self

    def _map(self, fn) -> ESSHCache:
        """A cache whose every tensor is ``fn(tensor)`` (a batch-dim edit or view); rings share its positions."""
        positions = fn(self.positions)
        layers = [fn(s) if isinstance(s, torch.Tensor) else
                  RingState(fn(s.keys), fn(s.values), fn(s.slot_pos), positions) for s in self.layers]
        return ESSHCache(batch=int(positions.shape[0]), tier=self.tier, layers=layers, positions=positions)

    @torch.no_grad()
    def apply_(self, fn) -> ESSHCache:
        """Replace every tensor by ``fn(tensor)`` along the batch dim (a beam reorder, a row selection, a
        repetition), in place of this cache's fields; returns it. The rings keep sharing ``positions``."""
        edited = self._map(fn)
        self.layers, self.positions, self.batch = edited.layers, edited.positions, edited.batch
        return self

    def at_tier(self, tier: Tier) -> ESSHCache:
        """A cache of views at the narrower ``tier`` (the first ``tier.K`` channels of every mode state, the same
        rings and positions): how a row of a mixed-tier ``FastDecoder`` is prefilled at its own tier."""
        if tier == self.tier:
            return self
        if tier.K > self.tier.K:
            raise ValueError(f"a cache of {self.tier.name} (K={self.tier.K}) holds no state for {tier.name} "
                             f"(K={tier.K}); allocate it at the widest tier served")
        layers = [s[:, :tier.K] if isinstance(s, torch.Tensor) else s for s in self.layers]
        return ESSHCache(batch=self.batch, tier=tier, layers=layers, positions=self.positions)

    def narrow(self, rows: int, start: int = 0) -> ESSHCache:
        """A cache of views of sequences ``start .. start + rows - 1`` (writes land in this cache)."""
        if not (1 <= rows and 0 <= start and start + rows <= self.batch):
            raise ValueError(f"cannot take {rows} rows from row {start} of a cache built for batch {self.batch}")
        return self._map(lambda t: t[start:start + rows])


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
    def allocate(cls, model, batch: int, tier: TierLike = None, *, decode: str = "exact",
                 n_modes: int = 8, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, **unknown: Any) -> ESSSMCache:
        """Zeroed cache. ``state_dtype`` defaults to float32 (float64 for a float64 model); ``kv_dtype`` is
        accepted for the generation contract and unused (ES-SSM keeps no keys or values)."""
        if unknown:
            raise ValueError(f"unknown ES-SSM cache option(s) {sorted(unknown)}; allocate_cache takes batch, tier,"
                             " decode ('exact' | 'modal'), n_modes and state_dtype")
        cfg = model.config
        if cfg.task != "lm":
            raise ValueError("cached decoding needs an ES-SSM language model (task='lm'); a classifier has"
                             " no next token")
        decode, n_modes = check_decode(decode, n_modes, cfg.seq_len)
        state_dtype = _state_dtype(model, batch, state_dtype, kv_dtype)
        t = model.resolve_tier(tier)
        layers = {i: b.mixer.init_state(batch, t, state_dtype=state_dtype, decode=decode, n_modes=n_modes)
                  for i, b in enumerate(model.blocks)}
        return cls(batch=batch, tier=t, decode=decode, n_modes=n_modes, layers=layers)

    def nbytes(self) -> dict[str, int]:
        """Per-cache state in bytes: ``recurrent`` (ring buffers or mode states), ``kv`` (0), ``total``."""
        return _nbytes(self.states.values())

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
