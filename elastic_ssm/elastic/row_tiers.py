"""Rows of one batch at different tiers: every row computes at the widest tier, and two per-row factors keep only
its own tier's prefix in effect (issue 39, "every tier in one batch").

Tiers are nested prefixes of the same weights (ESSH Sec. 4.1, D.2): a row at tier T reads out its first K_T
spectral channels and its first n_ff(T) FFN units. At the widest tier (K, n_ff) the readout of a row at T is

    y = K^{-1/2} W^out (s * z),   s = sqrt(K / K_T) on the first K_T P entries of z [K P], 0 after,

which is ``K_T^{-1/2} W^out_{:, :K_T P} z_{:K_T}``, its own tier's readout; the FFN's SiLU(gate) * up [n_ff] is
multiplied by a 0/1 unit mask. Channels and units past a row's prefix are computed and discarded: the cost is the
widest tier's, and the kernels run at one shape for every mix. The decode step uses the same two factors
(``FastDecoder(mixed=True)``); the forward and the prefill graphs use them through ``RowTiers``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from .tiers import Tier

__all__ = ["RowTiers", "write_row_factors"]


def write_row_factors(scale: torch.Tensor, units: torch.Tensor, widest: Tier, tier: Tier, value_width: int,
                      whose: str = "", fix: str = "run the batch at the widest tier of its rows") -> None:
    """Write one row's factors in place: ``scale`` [K P] (sqrt(K / K_T) on the first K_T P entries, 0 after) and
    ``units`` [n_ff] (1 on the first n_ff(T), 0 after), for a row at ``tier`` of a batch at ``widest``; ``whose`` and
    ``fix`` word the error for a tier wider than ``widest``."""
    if tier.K > widest.K or tier.n_ff > widest.n_ff:
        raise ValueError(f"tier {tier.name} (K={tier.K}, n_ff={tier.n_ff}) is wider than {whose}{widest.name} "
                         f"(K={widest.K}, n_ff={widest.n_ff}); {fix}")
    keep = tier.K * value_width
    scale[:keep] = math.sqrt(widest.K / tier.K)
    scale[keep:] = 0.0
    units[:tier.n_ff] = 1.0
    units[tier.n_ff:] = 0.0


@dataclass(eq=False)
class RowTiers:
    """A batch whose rows run at tiers nested in ``widest``, computed at ``widest`` (``K``, ``n_ff`` and ``name`` are
    its, so layers size their work as at ``widest``). ``channel_scale`` [B, K P] and ``unit_mask`` [B, n_ff] are the
    factors of ``write_row_factors`` (float32, or the dtype given)."""

    widest: Tier
    channel_scale: torch.Tensor
    unit_mask: torch.Tensor

    @classmethod
    def build(cls, widest: Tier, tiers: Sequence[Tier], value_width: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> RowTiers:
        out = cls(widest, torch.empty(len(tiers), widest.K * value_width, dtype=dtype, device=device),
                  torch.empty(len(tiers), widest.n_ff, dtype=dtype, device=device))
        out.assign(tiers, value_width)
        return out

    def assign(self, tiers: Sequence[Tier], value_width: int) -> None:
        """Rewrite the factors in place for ``tiers`` (one per row; rows past them repeat the first): a captured
        graph that reads these buffers stays valid."""
        if not 1 <= len(tiers) <= self.batch:
            raise ValueError(f"{len(tiers)} row tiers for a batch of {self.batch}")
        host_s = torch.empty(self.channel_scale.shape, dtype=self.channel_scale.dtype)   # [B, K P]
        host_u = torch.empty(self.unit_mask.shape, dtype=self.unit_mask.dtype)           # [B, n_ff]
        for row, t in enumerate(list(tiers) + [tiers[0]] * (self.batch - len(tiers))):
            write_row_factors(host_s[row], host_u[row], self.widest, t, value_width)
        self.channel_scale.copy_(host_s)
        self.unit_mask.copy_(host_u)

    @property
    def batch(self) -> int:
        return self.channel_scale.shape[0]

    K = property(attrgetter("widest.K"))
    n_ff = property(attrgetter("widest.n_ff"))
    name = property(attrgetter("widest.name"))
