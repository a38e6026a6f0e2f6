"""RMSNorm and SwiGLU of decode rows, one fused kernel each::

    rms_norm(x, weight, eps)   y = weight * x / sqrt(mean_j x_j^2 + eps)          x [B, D] -> [B, D]
    swiglu(h)                  y_j = silu(h_{2j}) * h_{2j+1}                      h [B, 2n] -> [B, n]

``backend="triton"`` runs ``triton_kernels.py``; ``"torch"`` is the reference (also for float64, non-2-D inputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import pow2, resolve_decode_backend

__all__ = ["rms_norm", "swiglu"]


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    return resolve_decode_backend(backend, x.device) == "triton" and x.dtype != torch.float64 and x.dim() == 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm of rows ``x [B, D]`` (the torch path: any ``[..., D]``) with ``weight [D]`` (float32 arithmetic for
    half inputs, output in ``x.dtype``)."""
    if not _use_triton(x, backend):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return F.rms_norm(xf, (xf.shape[-1],), weight.to(xf.dtype), eps).to(x.dtype)
    from .triton_kernels import rms_norm_kernel

    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty_like(x)
    B, D = x.shape
    rms_norm_kernel[(B,)](x, weight, y, D, x.stride(0), y.stride(0), eps, BLOCK_D=pow2(D, 16),
                          num_warps=4 if D <= 2048 else 8)
    return y


def swiglu(h: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of interleaved pairs: ``h [B, 2n]``, ``(gate_j, up_j)`` at ``(2j, 2j+1)`` -> ``[B, n]``."""
    if not _use_triton(h, backend):
        g = h.unflatten(-1, (-1, 2))  # [B, n, 2] (gate, up) pairs
        return F.silu(g[..., 0]) * g[..., 1]
    from .triton_kernels import swiglu_kernel

    h = h if h.stride(-1) == 1 else h.contiguous()
    B, N = h.shape[0], h.shape[1] // 2
    y = torch.empty(B, N, dtype=h.dtype, device=h.device)
    block = 1024
    swiglu_kernel[(B, -(-N // block))](h, y, N, h.stride(0), y.stride(0), BLOCK_N=block, num_warps=4)
    return y
