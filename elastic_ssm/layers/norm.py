"""RMSNorm (Zhang & Sennrich, 2019), the pre-norm of every ESSH block and the final norm."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.norm_swiglu import rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim D; computed in float32 under autocast."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight, self.eps, backend="torch")
