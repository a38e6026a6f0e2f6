"""Triton kernel of the fused decode step (math and reference: ``decode_triton.py``); imports triton."""

from __future__ import annotations

import triton
import triton.language as tl

from ..gemv.triton_kernels import pdl_enter


@triton.jit
def spectral_step_kernel(h_ptr, state_ptr, out_ptr, tab_ptr, beta_ptr, K, P, M, stride_h, stride_o,
                         eps, scale, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # programmatic dependent launch (ops/gemv): nothing is read before the wait
    pid = tl.program_id(0)
    b = pid // K
    k = pid % K
    op = tl.arange(0, BLOCK_P)
    om = tl.arange(0, BLOCK_M)
    mp = op < P
    mm = om < M
    row = h_ptr + b * stride_h + k * (P + 3 * M)
    v0 = tl.load(row + op, mask=mp, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + k)
    rms = tl.rsqrt(tl.sum(v0 * v0, 0) / P + eps)
    v = (1 - beta) * v0 + beta * (v0 * rms)                           # Eq. 23
    tab = tab_ptr + k * 9 * M + om
    pre = row + P + om
    sw = tl.load(pre, mask=mm, other=0.0).to(tl.float32) + tl.load(tab, mask=mm, other=0.0)
    sr = tl.load(pre + M, mask=mm, other=0.0).to(tl.float32) + tl.load(tab + M, mask=mm, other=0.0)
    sc = tl.load(pre + 2 * M, mask=mm, other=0.0).to(tl.float32) + tl.load(tab + 2 * M, mask=mm, other=0.0)
    w = 2 * tl.sigmoid(sw)
    r = 2 * tl.sigmoid(sr)
    decay = tl.load(tab + 3 * M, mask=mm, other=0.0) * tl.sigmoid(-sc)
    cs = tl.load(tab + 4 * M, mask=mm, other=0.0)
    sn = tl.load(tab + 5 * M, mask=mm, other=0.0)
    kc = tl.load(tab + 6 * M, mask=mm, other=0.0)
    ks = tl.load(tab + 7 * M, mask=mm, other=0.0)
    akc = tl.load(tab + 8 * M, mask=mm, other=0.0)
    sbase = state_ptr + (b * K + k) * M * 2 * P
    idx = om[:, None] * (2 * P) + op[None, :]
    m2 = mm[:, None] & mp[None, :]
    h0 = tl.load(sbase + idx, mask=m2, other=0.0)
    h1 = tl.load(sbase + idx + P, mask=m2, other=0.0)
    d = decay[:, None]
    n0 = d * (cs[:, None] * h0 - sn[:, None] * h1) + w[:, None] * v[None, :]   # Eq. 5
    n1 = d * (sn[:, None] * h0 + cs[:, None] * h1)
    tl.store(sbase + idx, n0, mask=m2)
    tl.store(sbase + idx + P, n1, mask=m2)
    z = tl.sum((r * kc)[:, None] * n0 - (r * ks)[:, None] * n1, 0) - tl.sum(r * w * akc, 0) * v
    tl.store(out_ptr + b * stride_o + k * P + op, (z * scale).to(out_ptr.dtype.element_ty), mask=mp)
