"""Helpers for tests and shape benchmarks of ESSH models (not part of the architecture in ``essh.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .essh import ESSH

__all__ = ["randomize_selective"]


@torch.no_grad()
def randomize_selective(model: ESSH, ffn_out_std: float = 0.05, zero_lag: bool = False) -> ESSH:
    """Move a freshly initialised ESSH away from its near-identity start (gates at one, beta 0), for tests
    and shape benchmarks: random gate/clock weights (std 0.3) and biases (std 0.5), blend beta in [0, 1),
    SwiGLU down projections with std ``ffn_out_std``; with ``zero_lag`` also a ~ U[0, 1). Uses the global
    torch RNG; returns ``model``."""
    c = model.config
    P = c.value_width
    for b in model.blocks:
        if b.kind == "S":
            b.mixer.in_proj.weight.view(-1, P + 3 * c.n_modes, c.d_model)[:, P:].normal_(std=0.3)
            b.mixer.gate_bias.normal_(std=0.5)
            b.mixer.beta.uniform_(0, 1)
            if zero_lag:
                b.mixer.a.uniform_(0, 1)
        w = b.ffn.w_out.weight
        w.copy_(w.new_empty(c.d_ff, c.d_model).normal_(std=ffn_out_std).t())   # drawn unit-major
    return model
