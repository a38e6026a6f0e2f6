"""Decode state of one sliding-window-attention layer (ESSH Table 53): a ring of ``window`` key/value slots;
slot ``p mod W`` holds position p (``slot_pos``; -1 = empty), ``positions`` [B] is shared by the cache's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RingState:
    """Window ring of one attention layer: keys / values [B, H, W, hd], slot_pos [B, W], positions [B]."""

    keys: torch.Tensor
    values: torch.Tensor
    slot_pos: torch.Tensor
    positions: torch.Tensor

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              valid: torch.Tensor | None) -> None:
        """Store keys/values [B, H, T, hd] of the last ``window`` valid tokens at slots ``pos % window``: T = 1
        (a decode step) writes its slot; T > 1 fills an empty ring, slot s gathering position ``s + W floor((n - 1
        - s) / W)`` of a row's n valid tokens (empty when s >= n): fixed-shape and host-sync-free."""
        B, _, T, _ = k.shape
        W = self.window
        if T == 1 and valid is None:
            rows, slot = torch.arange(B, device=k.device), positions[:, 0] % W
            self.keys[rows, :, slot] = k[:, :, 0].to(self.keys.dtype)
            self.values[rows, :, slot] = v[:, :, 0].to(self.values.dtype)
            self.slot_pos[rows, slot] = positions[:, 0]
            return
        n = torch.full((B,), T, device=k.device) if valid is None else valid.long().sum(1)   # [B]
        s = torch.arange(W, device=k.device)
        p = s + W * torch.div(n[:, None] - 1 - s, W, rounding_mode="floor")              # [B, W]
        held = s < n[:, None]
        idx = (T - n[:, None] + p).clamp(0, T - 1)                                         # token index [B, W]
        gather = idx[:, None, :, None].expand(B, k.shape[1], W, k.shape[3])
        keep = held[:, None, :, None]
        self.keys.copy_(torch.where(keep, k.gather(2, gather), 0).to(self.keys.dtype))
        self.values.copy_(torch.where(keep, v.gather(2, gather), 0).to(self.values.dtype))
        self.slot_pos.copy_(torch.where(held, p, -1))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
