"""Triton kernels of the decode step's row kernels (see ``ops/gemv/__init__.py`` for the math).

* ``rows_gemv_kernel``: ``y[b, n] = sum_d W[n, d] u[b, d]``, W row-major ``[N, D]``; one program owns ``BLOCK_N``
  outputs and walks D in ``BLOCK_K`` tiles, with the input's RMSNorm from the same pass, a SwiGLU variant on
  interleaved (gate, up) rows and a residual variant that adds into its output rows.
* ``cols_gemv_kernel``: ``x[b, d] += scale * sum_n a[b, n] W[n, d]``, W ``[N, D]`` input x output (the split
  layout's copies); ``BLOCK_D`` output columns, N split into ``SPLIT`` ranges, float32 atomics into the
  residual stream (results agree to float32 rounding, not bitwise, between runs).

* ``rms_norm_kernel``, grid ``(B,)``: one program per row holds the whole row (``BLOCK_D >= D``), reduces the
  mean square in float32 and writes ``weight * x * rsqrt(mean + eps)`` in the output dtype.
* ``swiglu_kernel``, grid ``(B, cdiv(n, BLOCK_N))``: reads the interleaved (gate, up) pairs of ``BLOCK_N`` units
  and writes ``silu(gate) * up`` computed in float32.

Reduction lengths are compile-time constants; batch rows ``b < B <= BLOCK_B`` share one read of the weights.
This module imports triton: import it only on the Triton path (``TRITON_INTERPRET=1`` must be set before).
``pdl_enter`` is the prologue of every decode kernel that reads nothing before the PDL wait."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Prologue of a PDL kernel that reads nothing before the wait: signal the successor, then wait for
    the predecessor's writes. With ``PDL=False`` it emits nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _rows_tile(acc, ss, x_ptr, g_ptr, offs_b, mb, stride_xb, kk, mk, w, HAS_NORM: tl.constexpr,
               BLOCK_B: tl.constexpr):
    """acc [BLOCK_B, R] += u W_tile^T over one column tile ``kk``; ``ss`` += the tile's sum of squares."""
    u = tl.load(x_ptr + offs_b[:, None] * stride_xb + kk[None, :], mask=mb[:, None] & mk[None, :],
                other=0.0).to(tl.float32)
    if HAS_NORM:
        ss += tl.sum(u * u, axis=1)
        u = u * tl.load(g_ptr + kk, mask=mk, other=0.0).to(tl.float32)[None, :]
    w = w.to(tl.float32)
    if BLOCK_B == 1:
        acc += tl.sum(w * u, axis=1)[None, :]
    else:
        acc += tl.sum(u[:, None, :] * w[None, :, :], axis=2)
    return acc, ss


@triton.jit
def rows_gemv_kernel(x_ptr, g_ptr, w_ptr, y_ptr, B, N, D: tl.constexpr, stride_xb, stride_wn, stride_yb, eps,
                     HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """N outputs per batch row; with SWIGLU the weight has 2N rows (gate_n, up_n) and N units are written.

    One pass over D: the weight tile, the input tile and the input's sum of squares together; the norm is a
    per-row scalar, so ``W (g x / rms) = (W (g x)) / rms`` is applied once at the end (no prologue). When
    one tile covers D (``BLOCK_K >= D``) the program's whole weight slab is read before ``gdc_wait``
    (``ops/gemv/__init__.py``): with PDL it streams while the previous kernel finishes."""
    if PDL:
        gdc_launch_dependents()
    R: tl.constexpr = BLOCK_N * 2 if SWIGLU else BLOCK_N            # weight rows per program
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    mb = offs_b < B
    offs_r = pid * R + tl.arange(0, R)
    mr = offs_r < N * (2 if SWIGLU else 1)
    acc = tl.zeros([BLOCK_B, R], tl.float32)
    ss = tl.zeros([BLOCK_B], tl.float32)
    if BLOCK_K >= D:
        kk = tl.arange(0, BLOCK_K)
        mk = kk < D
        w = tl.load(w_ptr + offs_r[:, None] * stride_wn + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        if PDL:
            gdc_wait()
        acc, ss = _rows_tile(acc, ss, x_ptr, g_ptr, offs_b, mb, stride_xb, kk, mk, w, HAS_NORM, BLOCK_B)
    else:
        if PDL:
            gdc_wait()
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            mk = kk < D
            w = tl.load(w_ptr + offs_r[:, None] * stride_wn + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            acc, ss = _rows_tile(acc, ss, x_ptr, g_ptr, offs_b, mb, stride_xb, kk, mk, w, HAS_NORM, BLOCK_B)
    if HAS_NORM:
        acc = acc * (1.0 / tl.sqrt(ss / D + eps))[:, None]
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_B, BLOCK_N, 2]))
        acc = gate * tl.sigmoid(gate) * up
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    out = y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :]
    m2 = mb[:, None] & (offs_n < N)[None, :]
    if RESIDUAL:
        acc += tl.load(out, mask=m2, other=0.0).to(tl.float32)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def cols_gemv_kernel(a_ptr, w_ptr, x_ptr, B, N, D, stride_ab, stride_wn, stride_xb, scale, ROWS: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Rows ``[n_start, n_start + ROWS)`` of W times the matching inputs, added into BLOCK_D columns of x.
    With PDL the program only signals and waits (``ops/gemv/__init__.py``): the pipelined row-tile loop keeps
    several weight tiles in flight, which reading one tile before the wait would break."""
    pdl_enter(PDL)
    pid_d = tl.program_id(0)
    n_start = tl.program_id(1) * ROWS
    offs_b = tl.arange(0, BLOCK_B)
    mb = offs_b < B
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    acc = tl.zeros([BLOCK_B, BLOCK_D], tl.float32)
    for n0 in range(0, ROWS, BLOCK_N):
        nn = n_start + n0 + tl.arange(0, BLOCK_N)
        mn = (nn < N) & (n0 + tl.arange(0, BLOCK_N) < ROWS)
        av = tl.load(a_ptr + offs_b[:, None] * stride_ab + nn[None, :], mask=mb[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)
        w = tl.load(w_ptr + nn[:, None] * stride_wn + offs_d[None, :], mask=mn[:, None] & md[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(av[:, :, None] * w[None, :, :], axis=1)
    tl.atomic_add(x_ptr + offs_b[:, None] * stride_xb + offs_d[None, :], acc * scale,
                  mask=mb[:, None] & md[None, :], sem="relaxed")


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
