"""Sliding-window causal self-attention with RoPE (ESSH Sec. 4, Appendix E.2).

Query i attends keys j with 0 <= i - j < window (``window_mask``). ``qkv`` [3D, D] and ``out`` [D, D], no biases
(Table 4), shared by every tier. Causal SDPA, a flex_attention band or masked SDPA by length and device
(docs/performance.md). Decoding state (Table 53): a ``RingState`` per layer."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..elastic.slicing import empty_linear, linear, linear_weight
from ..ops.dispatch import pow2
from ..ops.swa_decode import apply_rope, ring_attend, rope_cos_sin, rope_inv_freq
from .decode_plan import AttentionPlan


@dataclass
class RingState:
    """Window ring of one attention layer: keys / values [B, H, W, hd], slot_pos [B, W] (slot ``p mod W`` holds
    position p; -1 = empty), positions [B] (shared by the cache's layers)."""

    keys: torch.Tensor
    values: torch.Tensor
    slot_pos: torch.Tensor
    positions: torch.Tensor

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Store keys/values [B, H, T, hd] of the last ``window`` valid tokens at slots ``pos % window``: T = 1
        (a decode step) writes its slot; T > 1 fills an empty ring, slot s gathering position ``s + W floor((n - 1
        - s) / W)`` of a row's n valid tokens (empty when s >= n; only the first min(T, W) slots can be held, so
        only they are gathered): fixed-shape and host-sync-free."""
        B, _, T, _ = k.shape
        W, S = self.window, min(T, self.window)
        if T == 1 and valid is None:
            rows, slot = torch.arange(B, device=k.device), positions[:, 0] % W
            self.keys[rows, :, slot] = k[:, :, 0].to(self.keys.dtype)
            self.values[rows, :, slot] = v[:, :, 0].to(self.values.dtype)
            self.slot_pos[rows, slot] = positions[:, 0]
            return
        n = torch.full((B,), T, device=k.device) if valid is None else valid.long().sum(1)   # [B]
        s = torch.arange(W, device=k.device)
        p = s + W * torch.div(n[:, None] - 1 - s, W, rounding_mode="floor")              # [B, W]
        held = s < n[:, None]
        idx = (T - n[:, None] + p).clamp(0, T - 1)                                         # token index [B, W]
        gather = idx[:, None, :S, None].expand(B, k.shape[1], S, k.shape[3])
        keep = held[:, None, :S, None]
        for ring, x in ((self.keys, k), (self.values, v)):
            ring[:, :, :S].copy_(torch.where(keep, x.gather(2, gather), 0).to(ring.dtype))
            ring[:, :, S:].zero_()
        self.slot_pos.copy_(torch.where(held, p, -1))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B|1, 1, Tq, Tk] mask: 0 <= q - k < window, key valid (padding queries see themselves)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = (diff >= 0) & (diff < window)
    if k_valid is not None:
        allowed = (allowed & k_valid[..., None, :]) | (diff == 0)
    if allowed.dim() == 2:
        allowed = allowed[None]
    return allowed[:, None]


#: "auto" (flex_attention for unpadded CUDA inputs longer than the window) or "masked" (always the SDPA band
#: mask path); from the environment variable ELASTIC_SSM_SWA_KERNEL at import, settable at run time.
def swa_kernel(raw: str | None) -> str:
    """The kernel choice ``raw`` names; an unknown one is named in a warning and is ``auto``."""
    kernel = (raw or "").strip().lower() or "auto"
    if kernel in ("auto", "masked"):
        return kernel
    logging.getLogger("elastic_ssm").warning("ELASTIC_SSM_SWA_KERNEL=%r is neither auto nor masked; using auto", raw)
    return "auto"


SWA_KERNEL = swa_kernel(os.environ.get("ELASTIC_SSM_SWA_KERNEL"))


def swa_block_mask(T: int, window: int, device, block_size: int = 128):
    """flex_attention ``BlockMask`` of the causal band ``0 <= q - k < window`` for length T.

    Built at tile level without a [T, T] mask: for query tile i and key tile j, ``q - k`` ranges over
    ``(i - j) bs +- (bs - 1)``; tiles inside the band are "full" (no mask_mod call), tiles that cross an
    edge "partial", the rest are skipped."""
    nb = -(-T // block_size)
    rel = (torch.arange(nb, device=device)[:, None] - torch.arange(nb, device=device)[None, :]) * block_size
    lo, hi = rel - (block_size - 1), rel + (block_size - 1)  # [nb, nb] extremes of q - k in the tile
    full = (lo >= 0) & (hi < window)
    partial = (hi >= 0) & (lo < window) & ~full

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < window)

    def ordered(m: torch.Tensor):  # counts [1, 1, nb] and tile indices, selected tiles first [1, 1, nb, nb]
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=band, seq_lengths=(T, T))


_cached_block_mask = functools.lru_cache(maxsize=16)(swa_block_mask)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


#: How many shapes the eager-mode flex call may compile in one process (below torch.compile's recompile limit);
#: later shapes take the masked SDPA path (docs/performance.md).
FLEX_MAX_SHAPES = 7

#: The narrowest head flex_attention's kernels take; narrower heads take the masked SDPA path.
FLEX_MIN_HEAD_DIM = 16
_flex_shapes: set = set()


def flex_length(T: int, block_size: int = 128) -> int:
    """The length flex_attention runs a T-token sequence at: the next power of two (at least one tile); the
    padding after the last token is never attended (causal band) and is dropped, so the result is exact."""
    return pow2(max(T, block_size))


def flex_admits(q: torch.Tensor, block_size: int = 128) -> bool:
    """Whether the eager flex call may run q [B, H, T, hd]: its shape was compiled already, or fewer than
    ``FLEX_MAX_SHAPES`` shapes were (then it is counted)."""
    key = (*q.shape[:2], flex_length(q.shape[-2], block_size), q.shape[-1], q.dtype, q.device,
           torch.is_grad_enabled() and q.requires_grad)
    if key in _flex_shapes:
        return True
    if len(_flex_shapes) >= FLEX_MAX_SHAPES:
        if not getattr(flex_admits, "warned", False):
            flex_admits.warned = True
            logging.getLogger("elastic_ssm").warning(
                "sliding-window attention: flex_attention was compiled for %d shapes already; new shapes (here "
                "%s) take the masked SDPA path (exact, slower)", FLEX_MAX_SHAPES, tuple(q.shape))
        return False
    _flex_shapes.add(key)
    return True


def swa_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block_size: int = 128,
             compiled: bool = True) -> torch.Tensor:
    """Sliding-window causal attention of unpadded q, k, v [B, H, T, hd] through ``flex_attention``.

    ``compiled``: run flex_attention through ``torch.compile`` (its fast kernels; inside an already
    compiled graph it is traced in place). False runs the eager reference (tests on CPU). Outside a compiled
    graph the sequence runs at ``flex_length(T)``."""
    T = q.shape[-2]
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=swa_block_mask(T, window, q.device, block_size))
    Tp = flex_length(T, block_size)   # contiguous whether padded or not: one compiled kernel per length bucket
    q, k, v = (F.pad(t, (0, 0, 0, Tp - T)).contiguous() for t in (q, k, v))
    mask = _cached_block_mask(Tp, window, q.device, block_size)
    return (_compiled_flex() if compiled else flex_attention)(q, k, v, block_mask=mask)[..., :T, :]


def rope_qkv(qkv: nn.Module, x: torch.Tensor, positions: torch.Tensor, n_heads: int, head_dim: int, base: float):
    """x [B,T,D], positions [B,T] -> q, k, v [B,H,T,hd] through ``qkv`` (weight [3D, D]) with RoPE on q and k."""
    B, T, _ = x.shape
    q, k, v = linear(qkv, x).view(B, T, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)
    cos, sin = rope_cos_sin(positions, head_dim, base, q.dtype)
    cos, sin = cos[:, None], sin[:, None]                      # [B,1,T,hd/2]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class SlidingWindowAttention(nn.Module):
    def __init__(self, d_model: int, head_dim: int, window: int, rope_base: float = 10000.0,
                 init_std: float = 0.02, out_std: float | None = None) -> None:
        super().__init__()
        self.d_model, self.head_dim, self.window, self.rope_base = d_model, head_dim, window, rope_base
        self.n_heads = d_model // head_dim
        self.init_std, self.out_std = init_std, out_std if out_std is not None else init_std
        self.qkv = empty_linear(d_model, 3 * d_model)   # weight [3D, D]: q, k, v rows
        self.out = empty_linear(d_model, d_model)       # weight [D, D]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.qkv.weight.device.type == "meta":
            return
        nn.init.normal_(self.qkv.weight, std=self.init_std)
        nn.init.normal_(self.out.weight, std=self.out_std)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        return rope_qkv(self.qkv, x, positions, self.n_heads, self.head_dim, self.rope_base)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None,
                ring: RingState | None = None) -> torch.Tensor:
        """x [B,T,D]; positions [B,T] absolute token positions; valid [B,T] bool (None: all valid); an empty
        ``ring`` (this layer's decode state) receives the last ``window`` keys and values."""
        B, T, D = x.shape
        q, k, v = self._qkv(x, positions)
        idx = torch.arange(T, device=x.device)
        W = self.window
        if T <= W and valid is None:
            # The window covers every earlier token: plain causal attention (flash kernel on GPU).
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif (valid is None and x.is_cuda and SWA_KERNEL == "auto" and self.head_dim >= FLEX_MIN_HEAD_DIM
              and (torch.compiler.is_compiling() or flex_admits(q))):
            o = swa_flex(q, k, v, W)
        elif T <= 2 * W:
            mask = window_mask(idx, idx, W, valid)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            blocks = []
            for s in range(0, T, W):
                e, ks = min(s + W, T), max(0, s - W + 1)
                kv = valid[:, ks:e] if valid is not None else None
                mask = window_mask(idx[s:e], idx[ks:e], W, kv)
                blocks.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e],
                                                             attn_mask=mask))
            o = torch.cat(blocks, dim=2)
        if ring is not None:
            ring.write(k, v, positions, valid)
        return linear(self.out, o.transpose(1, 2).reshape(B, T, D))

    def mix(self, x: torch.Tensor, tier=None, positions: torch.Tensor | None = None,
            valid: torch.Tensor | None = None, state: RingState | None = None, backend: str = "auto"):
        """The block's call (same for every mixer); attention is shared by every tier, so ``tier`` and the
        scan ``backend`` are unused."""
        return self(x, positions, valid, ring=state)

    def init_state(self, batch: int, tier=None, *, kv_dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None, positions: torch.Tensor | None = None,
                   **_: object) -> RingState:
        """This layer's slice of a decode cache: an empty ring of ``window`` key and value slots [B, H, W, hd]
        in ``kv_dtype`` (2 W d entries per sequence, Table 53) on the cache's ``positions`` [B] counter."""
        device = device or self.out.weight.device
        dtype = kv_dtype or self.out.weight.dtype
        shape = (batch, self.n_heads, self.window, self.head_dim)
        positions = torch.zeros(batch, dtype=torch.long, device=device) if positions is None else positions
        return RingState(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                         torch.full((batch, self.window), -1, dtype=torch.long, device=device), positions)

    def step(self, x: torch.Tensor, state: RingState, tier=None) -> torch.Tensor:
        """Reference single-token step: x [B,D] at positions ``state.positions`` [B]; writes the ring, then
        attends its allowed slots (the token itself included) -> [B,D]. Every tier shares the attention."""
        B, D = x.shape
        positions = state.positions
        q, k, v = self._qkv(x[:, None], positions[:, None])       # [B,H,1,hd]
        state.write(k, v, positions[:, None], None)
        o = ring_attend(q, state.keys, state.values, state.slot_pos, positions).to(x.dtype)  # [B,H,1,hd]
        return linear(self.out, o.reshape(B, D))

    @torch.no_grad()
    def decode_plan(self, tier=None, state_dtype: torch.dtype | None = None, split_copy: bool = False) -> AttentionPlan:
        """The fused step's weights (``layers/decode_plan.py``): ``qkv.weight`` [3D, D], ``out.weight``
        [D, D] (out x in, so no copy is needed) and the float64 RoPE table. Shared by every tier."""
        w_in, w_out = linear_weight(self.qkv), linear_weight(self.out)
        return AttentionPlan(w_in, w_out, rope_inv_freq(self.head_dim, self.rope_base, w_in.device))
