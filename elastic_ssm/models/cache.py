"""Inference cache of an ESSH model at one tier: one state per layer, each the layer's own ``init_state``.

Spectral layers: mode states [B, K_T, M, 2, P] (float32 by default, ESSH Sec. 4.3); attention layers: a
``RingState`` [B, H, W, hd] (bfloat16 on CUDA, Table 53); ``positions`` [B] is shared by every ring. Every tensor
stays at a fixed address (in-place writes), so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..elastic.tiers import Tier
from ..layers.window_ring import RingState


@dataclass
class ESSHCache:
    batch: int
    tier: Tier
    window: int
    layers: list = field(default_factory=list)     # per layer: mode state [B,K,M,2,P] or RingState
    positions: torch.Tensor | None = None           # [B] int64

    @classmethod
    def allocate(cls, model, batch: int, tier=None, device=None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> ESSHCache:
        """Zeroed cache for ``batch`` sequences at ``tier``. Defaults: fp32 mode states (float64 for a
        float64 model), a bf16 KV ring on CUDA and the parameter dtype on CPU."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"a cache needs batch >= 1 sequences, got {batch!r}")
        t = model.resolve_tier(tier)
        param = model.embed.weight
        device = torch.device(device) if device is not None else param.device
        if state_dtype is None:
            state_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        if kv_dtype is None:
            kv_dtype = torch.bfloat16 if device.type == "cuda" else param.dtype
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        layers = [b.mixer.init_state(batch, t, state_dtype=state_dtype, kv_dtype=kv_dtype, device=device,
                                     positions=positions) for b in model.blocks]
        return cls(batch=batch, tier=t, window=model.config.window, layers=layers, positions=positions)

    # ---- views by kind (for tests, benchmarks and memory accounting) ------------------------------------
    @property
    def states(self) -> dict[int, torch.Tensor]:
        """layer -> mode state [B, K, M, 2, P] of every spectral layer."""
        return {i: s for i, s in enumerate(self.layers) if isinstance(s, torch.Tensor)}

    @property
    def rings(self) -> dict[int, RingState]:
        """layer -> window ring of every attention layer."""
        return {i: s for i, s in enumerate(self.layers) if isinstance(s, RingState)}

    @property
    def keys(self) -> dict[int, torch.Tensor]:
        return {i: r.keys for i, r in self.rings.items()}

    @property
    def values(self) -> dict[int, torch.Tensor]:
        return {i: r.values for i, r in self.rings.items()}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (states, rings, slot positions, positions), for snapshots."""
        out = []
        for s in self.layers:
            out += [s] if isinstance(s, torch.Tensor) else [s.keys, s.values, s.slot_pos]
        return [*out, self.positions]

    def nbytes(self) -> dict[str, int]:
        rec = sum(s.numel() * s.element_size() for s in self.states.values())
        kv = sum(r.nbytes() for r in self.rings.values())
        return {"recurrent": rec, "kv": kv, "total": rec + kv}

    # ---- in-place reuse ------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_(self) -> ESSHCache:
        """Empty every sequence in place (zero states and rings, no slot filled, position 0)."""
        for s in self.layers:
            if isinstance(s, torch.Tensor):
                s.zero_()
            else:
                s.keys.zero_()
                s.values.zero_()
                s.slot_pos.fill_(-1)
        self.positions.zero_()
        return self

    def _map(self, fn) -> ESSHCache:
        """A cache whose every tensor is ``fn(tensor)`` (a batch-dim edit or view); rings share its positions."""
        positions = fn(self.positions)
        layers = [fn(s) if isinstance(s, torch.Tensor) else
                  RingState(fn(s.keys), fn(s.values), fn(s.slot_pos), positions) for s in self.layers]
        return ESSHCache(batch=int(positions.shape[0]), tier=self.tier, window=self.window, layers=layers,
                         positions=positions)

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
        return ESSHCache(batch=self.batch, tier=tier, window=self.window, layers=layers, positions=self.positions)

    def narrow(self, rows: int, start: int = 0) -> ESSHCache:
        """A cache of views of sequences ``start .. start + rows - 1`` (writes land in this cache)."""
        if not (1 <= rows and 0 <= start and start + rows <= self.batch):
            raise ValueError(f"cannot take {rows} rows from row {start} of a cache built for batch {self.batch}")
        return self._map(lambda t: t[start:start + rows])
