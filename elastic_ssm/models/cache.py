"""Inference cache of an ESSH model at one tier: recurrent mode states and SWA ring buffers.

Each spectral layer keeps its mode states ``[B, K_T, M, 2, P]`` (float32 by default: ESSH Sec. 4.3,
2 K_T m P entries per layer), each sliding-window-attention layer a ring buffer of ``window`` key and
value slots ``[B, H, W, hd]`` (bfloat16 by default, Table 53) and, shared by the SWA layers, the
absolute position held by every slot (``-1`` = empty). ``positions`` [B] is the next position of every
sequence (left padding does not count). Sizes follow the tier; ``nbytes`` equals
``elastic.tiers.state_bytes`` of the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..elastic.tiers import Tier


@dataclass
class ESSHCache:
    batch: int
    tier: Tier
    window: int
    states: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [B,K,M,2,P]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)        # layer -> [B,H,W,hd]
    values: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [B,H,W,hd]
    slot_pos: torch.Tensor | None = None                               # [B,W] int64
    positions: torch.Tensor | None = None                              # [B] int64

    @classmethod
    def allocate(cls, model, batch: int, tier=None, device=None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> ESSHCache:
        """Zeroed cache for ``batch`` sequences at ``tier``. Defaults: fp32 mode states (float64 for a
        float64 model), a bf16 KV ring on CUDA and the parameter dtype on CPU."""
        cfg = model.config
        t = model.resolve_tier(tier)
        if device is None or state_dtype is None or kv_dtype is None:
            param = model.embed.weight
            device = device or param.device
            if state_dtype is None:
                state_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
            if kv_dtype is None:
                kv_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else param.dtype
        P, M, W, H, hd = cfg.value_width, cfg.n_modes, cfg.window, cfg.n_heads, cfg.head_dim
        cache = cls(batch=batch, tier=t, window=W)
        for i, kind in enumerate(cfg.layout):
            if kind == "S":
                cache.states[i] = torch.zeros(batch, t.K, M, 2, P, dtype=state_dtype, device=device)
            else:
                cache.keys[i] = torch.zeros(batch, H, W, hd, dtype=kv_dtype, device=device)
                cache.values[i] = torch.zeros(batch, H, W, hd, dtype=kv_dtype, device=device)
        cache.slot_pos = torch.full((batch, W), -1, dtype=torch.long, device=device)
        cache.positions = torch.zeros(batch, dtype=torch.long, device=device)
        return cache

    def nbytes(self) -> dict[str, int]:
        rec = sum(s.numel() * s.element_size() for s in self.states.values())
        kv = sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())
        return {"recurrent": rec, "kv": kv, "total": rec + kv}

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor | None) -> None:
        """Store keys/values [B,H,T,hd] of the last ``window`` valid tokens at slots ``pos % window``."""
        B, _, T, _ = k.shape
        keep = torch.ones(B, T, dtype=torch.bool, device=k.device) if valid is None else valid.bool()
        last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=1, keepdim=True)
        keep = keep & (positions > last - self.window)
        b_idx, t_idx = keep.nonzero(as_tuple=True)
        slots = positions[b_idx, t_idx] % self.window
        kc, vc = self.keys[layer], self.values[layer]
        kc[b_idx, :, slots] = k[b_idx, :, t_idx].to(kc.dtype)
        vc[b_idx, :, slots] = v[b_idx, :, t_idx].to(vc.dtype)
        if layer == min(self.keys):  # slot positions are shared by all SWA layers: record them once
            self.slot_pos[b_idx, slots] = positions[b_idx, t_idx]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer], self.slot_pos
