"""One decode step of sliding-window attention on a ring buffer (ESSH Sec. 4 / Appendix E.2; Alg. 4), for each row
b (next position ``p = positions[b]``) and head h, from the raw projection ``qkv [B, 3 D]``::

    q, k  <- RoPE(q, p), RoPE(k, p)           halves convention of layers/attention.py, phases in float64
    K[b, h, p mod W], V[b, h, p mod W] <- k, v;   slot_pos[b, p mod W] <- p
    allowed_j = slot_pos_j >= 0  and  0 <= p - slot_pos_j < W
    o[b, h] = softmax_j(q . K_j / sqrt(hd) over allowed j) V                 -> o [B, D]

``SlidingWindowAttention.step`` without the output projection. ``backend="torch"``: the reference;
``"triton"``: a split-window kernel and a combine kernel. ``span``: docs/performance.md, "Attended spans".

Also the rotary position embedding (RoPE) itself, halves convention, phases in float64 (positions reach 1e5+); shared
by the attention layer and this one-token window step."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dispatch import pow2, resolve_decode_backend
from .gemv import launch_options

__all__ = ["swa_decode_step", "ring_attend", "rope_inv_freq", "cos_sin", "rope_cos_sin", "apply_rope",
           "MAX_TRITON_BATCH"]


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


# Above this batch the window read dominates and SDPA's kernel streams the ring faster than ours
# (H200, 1.5b, batch 128: 5.01 ms per step with the Triton pair vs 3.67 ms with SDPA).
MAX_TRITON_BATCH = 8


def _torch_step(qkv, keys, values, slot_pos, positions, inv_freq, attention: str, span: int) -> torch.Tensor:
    B, H, W, hd = keys.shape
    q, k, v = qkv.view(B, 3, H, hd).unbind(1)                             # [B, H, hd]
    cos, sin = cos_sin(positions[:, None], inv_freq, q.dtype)            # [B, 1, hd/2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows, slot = torch.arange(B, device=qkv.device), positions % W
    keys[rows, :, slot] = k.to(keys.dtype)
    values[rows, :, slot] = v.to(values.dtype)
    slot_pos[rows, slot] = positions
    return ring_attend(q[:, :, None], keys[:, :, :span], values[:, :, :span], slot_pos[:, :span], positions, attention,
                       window=W).reshape(B, H * hd)


def ring_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_pos: torch.Tensor,
                positions: torch.Tensor, attention: str = "math", window: int | None = None) -> torch.Tensor:
    """Softmax attention of one query per row over the ring's allowed slots: q [B, H, 1, hd] (rotated), keys /
    values [B, H, S, hd] (the current token written), slot_pos [B, S], positions [B] -> o [B, H, 1, hd] in
    ``values.dtype``. ``attention``: 'math' (scores in at least float32) | 'sdpa'. ``window``: W (default S)."""
    W, hd = window or keys.shape[2], keys.shape[3]
    diff = positions[:, None] - slot_pos
    allowed = (slot_pos >= 0) & (diff >= 0) & (diff < W)                  # [B, W]
    q = q.to(keys.dtype)
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None])
    s = (q @ keys.transpose(-1, -2)) / math.sqrt(hd)                      # [B, H, 1, W]
    s = s.to(torch.promote_types(s.dtype, torch.float32)).masked_fill(~allowed[:, None, None], float("-inf"))
    return s.softmax(-1).to(values.dtype) @ values


def _triton_step(qkv, keys, values, slot_pos, positions, inv_freq, out_dtype, chunk: int | None, pdl: bool, span: int):
    from .gemv.triton_kernels import swa_combine_kernel, swa_partial_kernel

    B, H, W, hd = keys.shape
    if keys.stride(3) != 1 or values.stride() != keys.stride() or slot_pos.stride(1) != 1:
        raise ValueError("the Triton window step needs contiguous keys/values [B, H, W, hd] and slot_pos")
    chunk = chunk or min(256, pow2(W))
    S = -(-span // chunk)                       # the chunks that hold slots 0 .. span - 1
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    m = torch.empty(B * H * S, dtype=torch.float32, device=qkv.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(B * H * S, hd, dtype=torch.float32, device=qkv.device)
    opts = launch_options(pdl)
    swa_partial_kernel[(B * H, S)](qkv, keys, values, slot_pos, positions, inv_freq, m, lsum, acc, H,
                                   qkv.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
                                   slot_pos.stride(0), 1.0 / math.sqrt(hd), W=W, HD=hd, CHUNK=chunk, S=S,
                                   BLOCK_W=min(64, chunk), PDL=pdl, num_warps=4, **opts)
    out = torch.empty(B, H * hd, dtype=out_dtype, device=qkv.device)
    swa_combine_kernel[(B * H,)](m, lsum, acc, out, H, out.stride(0), HD=hd, S=S,
                                 BLOCK_S=pow2(S), PDL=pdl, num_warps=4, **opts)
    return out


def swa_decode_step(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_pos: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, backend: str = "auto",
                    attention: str = "math", out_dtype: torch.dtype | None = None,
                    chunk: int | None = None, pdl: bool = False, span: int | None = None) -> torch.Tensor:
    """Attention output ``o [B, H hd]`` of one token per row; updates ``keys``, ``values`` [B, H, W, hd] and
    ``slot_pos`` [B, W] in place at ``positions`` [B] (not advanced here); ``inv_freq``: :func:`rope_inv_freq`.
    ``attention`` ('math' | 'sdpa'): the torch path's kernel; ``chunk``: the Triton window split; ``span``: attend
    the ring's first ``span`` slots only, exact when every row read has position < span."""
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"keys/values must both be [B, H, W, hd], got {tuple(keys.shape)} and {tuple(values.shape)}")
    B, H, W, hd = keys.shape
    if qkv.shape != (B, 3 * H * hd) or slot_pos.shape != (B, W) or positions.shape != (B,):
        raise ValueError(f"need qkv [B, 3 H hd] = [{B}, {3 * H * hd}], slot_pos [{B}, {W}], positions [{B}]; "
                         f"got {tuple(qkv.shape)}, {tuple(slot_pos.shape)}, {tuple(positions.shape)}")
    if hd % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {hd}")
    if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < 1):
        raise ValueError(f"span must be a number of ring slots >= 1 (or None: the whole ring), got {span!r}")
    span = W if span is None else min(span, W)
    use_triton = (resolve_decode_backend(backend, qkv.device) == "triton" and qkv.dtype != torch.float64
                  and B <= MAX_TRITON_BATCH and hd & (hd - 1) == 0)          # power-of-two head dim
    if use_triton:
        return _triton_step(qkv, keys, values, slot_pos, positions, inv_freq, out_dtype or qkv.dtype, chunk, pdl, span)
    return _torch_step(qkv, keys, values, slot_pos, positions, inv_freq, attention, span).to(out_dtype or qkv.dtype)
