"""Triton kernels of the one-token sliding-window attention step (math: ``ops/swa_decode/__init__.py``).

``swa_partial_kernel``, grid ``(B * H, S)``: program (b, h, s) rotates q and k of its head by the token's
absolute position (RoPE phases reduced mod 2 pi in float64, then cos/sin in float32), the program whose
chunk holds the ring slot ``pos % W`` writes k, v there (and ``slot_pos``), and every program runs an
online softmax over its ``CHUNK`` slots, using the fresh k, v for the current slot instead of memory (no
cross-program dependency inside the launch). It writes the running max, the sum and the unnormalised
output of its chunk. ``swa_combine_kernel``, grid ``(B * H,)``, merges the S chunks (flash-decoding).
This module imports triton: import it only on the Triton path."""

from __future__ import annotations

import triton
import triton.language as tl

from ..gemv.triton_kernels import pdl_enter


@triton.jit
def swa_partial_kernel(qkv_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, inv_ptr, m_ptr, l_ptr, acc_ptr, H,
                       stride_qb, stride_kb, stride_kh, stride_kw, stride_sb, sm_scale,
                       W: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr, S: tl.constexpr,
                       BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # programmatic dependent launch (ops/gemv): nothing is read before the wait
    HALF: tl.constexpr = HD // 2
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    pos = tl.load(pos_ptr + b)                                    # int64 position of this token
    cur = pos % W
    i = tl.arange(0, HALF)
    ang = pos.to(tl.float64) * tl.load(inv_ptr + i)               # float64 phase, reduced before cos/sin
    ang = ang - 6.283185307179586 * tl.floor(ang / 6.283185307179586)
    c = tl.cos(ang.to(tl.float32))
    sn = tl.sin(ang.to(tl.float32))
    row = qkv_ptr + b * stride_qb + h * HD
    D = H * HD
    q1 = tl.load(row + i).to(tl.float32)
    q2 = tl.load(row + HALF + i).to(tl.float32)
    k1 = tl.load(row + D + i).to(tl.float32)
    k2 = tl.load(row + D + HALF + i).to(tl.float32)
    v1 = tl.load(row + 2 * D + i).to(tl.float32)
    v2 = tl.load(row + 2 * D + HALF + i).to(tl.float32)
    qr1, qr2 = q1 * c - q2 * sn, q1 * sn + q2 * c
    kr1, kr2 = k1 * c - k2 * sn, k1 * sn + k2 * c
    kbase = kc_ptr + b * stride_kb + h * stride_kh
    vbase = vc_ptr + b * stride_kb + h * stride_kh
    start = s * CHUNK
    if (cur >= start) & (cur < start + CHUNK):                   # this chunk owns the ring slot
        tl.store(kbase + cur * stride_kw + i, kr1.to(kc_ptr.dtype.element_ty))
        tl.store(kbase + cur * stride_kw + HALF + i, kr2.to(kc_ptr.dtype.element_ty))
        tl.store(vbase + cur * stride_kw + i, v1.to(vc_ptr.dtype.element_ty))
        tl.store(vbase + cur * stride_kw + HALF + i, v2.to(vc_ptr.dtype.element_ty))
        tl.store(slot_ptr + b * stride_sb + cur, pos)             # same value from every head and layer
    m = tl.full([1], float("-inf"), tl.float32)
    lsum = tl.zeros([1], tl.float32)
    acc1 = tl.zeros([HALF], tl.float32)
    acc2 = tl.zeros([HALF], tl.float32)
    for w0 in range(0, CHUNK, BLOCK_W):
        offs = start + w0 + tl.arange(0, BLOCK_W)
        inside = offs < W
        sp = tl.load(slot_ptr + b * stride_sb + offs, mask=inside, other=-1)
        is_cur = offs == cur
        sp = tl.where(is_cur, pos, sp)
        diff = pos - sp
        ok = inside & (sp >= 0) & (diff >= 0) & (diff < W)
        kp = kbase + offs[:, None] * stride_kw + i[None, :]
        t1 = tl.load(kp, mask=ok[:, None], other=0.0).to(tl.float32)
        t2 = tl.load(kp + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        t1 = tl.where(is_cur[:, None], kr1[None, :], t1)
        t2 = tl.where(is_cur[:, None], kr2[None, :], t2)
        score = (tl.sum(t1 * qr1[None, :], 1) + tl.sum(t2 * qr2[None, :], 1)) * sm_scale
        score = tl.where(ok, score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - safe)
        p = tl.exp(score - safe)                                  # [BLOCK_W], 0 where masked
        vp = vbase + offs[:, None] * stride_kw + i[None, :]
        u1 = tl.load(vp, mask=ok[:, None], other=0.0).to(tl.float32)
        u2 = tl.load(vp + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        u1 = tl.where(is_cur[:, None], v1[None, :], u1)
        u2 = tl.where(is_cur[:, None], v2[None, :], u2)
        lsum = lsum * alpha + tl.sum(p, 0)
        acc1 = acc1 * alpha + tl.sum(p[:, None] * u1, 0)
        acc2 = acc2 * alpha + tl.sum(p[:, None] * u2, 0)
        m = m_new
    one = tl.arange(0, 1)
    tl.store(m_ptr + bh * S + s + one, m)
    tl.store(l_ptr + bh * S + s + one, lsum)
    tl.store(acc_ptr + (bh * S + s) * HD + i, acc1)
    tl.store(acc_ptr + (bh * S + s) * HD + HALF + i, acc2)


@triton.jit
def swa_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, H, stride_ob, HD: tl.constexpr, S: tl.constexpr,
                       BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    js = tl.arange(0, BLOCK_S)
    ms = js < S
    m = tl.load(m_ptr + bh * S + js, mask=ms, other=float("-inf"))
    lsum = tl.load(l_ptr + bh * S + js, mask=ms, other=0.0)
    top = tl.max(m, 0)
    wgt = tl.where(ms & (m > float("-inf")), tl.exp(m - top), 0.0)
    d = tl.arange(0, HD)
    acc = tl.load(acc_ptr + (bh * S + js[:, None]) * HD + d[None, :], mask=ms[:, None], other=0.0)
    o = tl.sum(wgt[:, None] * acc, 0) / tl.sum(wgt * lsum, 0)
    tl.store(o_ptr + b * stride_ob + h * HD + d, o.to(o_ptr.dtype.element_ty))
