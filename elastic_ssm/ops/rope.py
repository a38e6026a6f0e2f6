"""Rotary position embedding (RoPE), halves convention, phases in float64 (positions reach 1e5+); shared by the
attention layer and the one-token window step of the decoder."""

from __future__ import annotations

import torch

__all__ = ["rope_inv_freq", "cos_sin", "rope_cos_sin", "apply_rope"]


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    """``base ** (-2 i / head_dim)`` for i < head_dim / 2, float64 ``[head_dim / 2]``."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin ``[..., hd/2]`` in ``dtype`` of integer ``positions`` for the float64 table ``inv_freq``."""
    ang = positions.to(torch.float64)[..., None] * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos/sin tables [..., head_dim/2] for integer ``positions`` (phases in float64)."""
    return cos_sin(positions, rope_inv_freq(head_dim, base, positions.device), dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves (x[:h/2], x[h/2:]) by the position angle. x [..., hd], cos/sin broadcast to [..., hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
