"""Triton kernels of the decode step: the row kernels (math: ``ops/gemv/__init__.py``), the spectral mixer's fused
step (``ops/spectral_scan/decode_triton.py``) and the sliding-window attention step (``ops/swa_decode``).

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
* ``spectral_step_kernel``, grid ``(B * K,)``: one program per (row, channel) runs the fused decode step of
  ``decode_triton.py`` (its torch math is the reference).
* ``swa_partial_kernel``, grid ``(B * H, S)``: program (b, h, s) rotates q and k of its head by the token's absolute
  position (RoPE phases reduced mod 2 pi in float64, then cos/sin in float32), the program whose chunk holds the ring
  slot ``pos % W`` writes k, v there (and ``slot_pos``), and every program runs an online softmax over its ``CHUNK``
  slots, using the fresh k, v for the current slot instead of memory (no cross-program dependency inside the launch).
  It writes the running max, the sum and the unnormalised output of its chunk. ``swa_combine_kernel``, grid
  ``(B * H,)``, merges the S chunks (flash-decoding).

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
