"""Triton kernels of ``rms_norm`` and ``swiglu`` (math, launch and reference: ``ops/norm_swiglu/__init__.py``).

``rms_norm_kernel``, grid ``(B,)``: one program per row holds the whole row (``BLOCK_D >= D``), reduces the
mean square in float32 and writes ``weight * x * rsqrt(mean + eps)`` in the output dtype.
``swiglu_kernel``, grid ``(B, cdiv(n, BLOCK_N))``: reads the interleaved (gate, up) pairs of ``BLOCK_N``
units and writes ``silu(gate) * up`` computed in float32. This module imports triton: import it only on the
Triton path (``TRITON_INTERPRET=1`` must be set before, to run on CPU tensors)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    o = tl.arange(0, BLOCK_D)
    m = o < D
    x = tl.load(x_ptr + b * stride_x + o, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * w
    tl.store(y_ptr + b * stride_y + o, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_kernel(h_ptr, y_ptr, N, stride_h, stride_y, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = o < N
    g = tl.load(h_ptr + b * stride_h + 2 * o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + b * stride_h + 2 * o + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * stride_y + o, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=m)
