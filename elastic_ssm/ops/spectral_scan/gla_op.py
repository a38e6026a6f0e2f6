"""fla-core's chunked GLA kernels as two torch ops (``elastic_ssm::gla_chunk_fwd`` / ``_bwd``), so ``torch.compile``
traces around them; fla is imported when an op first runs. README.md, section on the fla path. Declared with
``torch.library.Library``: ``torch.library.custom_op`` runs each call through ``torch._disable_dynamo``, whose first
call imports ``torch._dynamo`` (1-2 s of a fresh process's first prefill, docs/performance.md)."""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dispatch import import_fla_chunk

_RCP_LN2 = 1.0 / math.log(2.0)
MIN_WIDTH = 16  # fla-core 0.6.0's backward (chunk_gla_bwd_dA: tl.dot over BV = next_pow2(Dv)) needs widths >= 16


def chunk_length(T: int) -> int:
    """The chunk length for a length-T sequence: 16 up to 16 positions, else 64 (never 32, which fla-core 0.6.0's
    ``chunk_gla_fwd_kernel_o`` fails with "misaligned address" on an H200 at the presets' widths)."""
    return 16 if T <= 16 else 64


def local_cumsum_log2(g: Tensor, C: int) -> Tensor:
    """Cumulative sum of ``g [B, T, H, D]`` within chunks of ``C`` positions, in base-2 units, float32: what fla's
    ``chunk_local_cumsum(g, C, scale=1/ln 2)`` computes, in torch so that B is no autotuning key."""
    B, T, H, D = g.shape
    n = -(-T // C)
    gp = F.pad(g.float(), (0, 0, 0, 0, 0, n * C - T))
    return (gp.view(B, n, C, H, D).cumsum(2).view(B, n * C, H, D)[:, :T] * _RCP_LN2).contiguous()


def _device(x: Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _empty_state(x: Tensor) -> Tensor:
    return x.new_empty(0, dtype=torch.float32)


_LIB = torch.library.Library("elastic_ssm", "FRAGMENT")
_LIB.define("gla_chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? h0, float scale, bool output_final_state)"
            " -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("gla_chunk_bwd(Tensor q, Tensor k, Tensor v, Tensor g_cumsum, Tensor? h0, Tensor A, Tensor do, Tensor? dht,"
            " float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.impl("elastic_ssm::gla_chunk_fwd", "default", lib=_LIB)
def _gla_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Tensor | None, scale: float,
                   output_final_state: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``o [B, T, H, Dv]`` (v.dtype), ``ht [B, H, Dk, Dv]`` float32 (empty unless ``output_final_state``),
    ``A [B, T, H, C]`` float32 and ``g_cumsum [B, T, H, Dk]`` float32 (the last two for the backward)."""
    fwd = import_fla_chunk().chunk_gla_fwd  # optional dependency (CUDA + triton)
    C = chunk_length(q.shape[1])
    with _device(q):
        g_cumsum, A, _, ht, o = fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), g_cumsum=local_cumsum_log2(g, C),
            scale=scale, initial_state=None if h0 is None else h0.contiguous(),
            output_final_state=output_final_state, cu_seqlens=None, chunk_size=C, chunk_indices=None)
    ht = _empty_state(q) if ht is None else ht.float()
    return o.to(v.dtype), ht, A.float(), g_cumsum.float()


@torch.library.register_fake("elastic_ssm::gla_chunk_fwd", lib=_LIB)
def _(q, k, v, g, h0, scale, output_final_state):
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    ht = q.new_empty(B, H, Dk, Dv, dtype=torch.float32) if output_final_state else _empty_state(q)
    A = q.new_empty(B, T, H, chunk_length(T), dtype=torch.float32)
    return torch.empty_like(v), ht, A, torch.empty_like(g, dtype=torch.float32)


@torch.library.impl("elastic_ssm::gla_chunk_bwd", "default", lib=_LIB)
def _gla_chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, h0: Tensor | None, A: Tensor, do: Tensor,
                   dht: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (input dtypes), ``dg`` float32 (gradient of the per-step gate ``g``) and ``dh0`` float32
    (empty when ``h0`` is None)."""
    bwd = import_fla_chunk().chunk_gla_bwd
    with _device(q):
        dq, dk, dv, dg, dh0 = bwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None, g_cumsum=g_cumsum.contiguous(),
            scale=scale, initial_state=None if h0 is None else h0.contiguous(), h=None, A=A.contiguous(),
            do=do.contiguous(), dht=None if dht is None else dht.contiguous(), cu_seqlens=None,
            chunk_size=chunk_length(q.shape[1]), chunk_indices=None)
    dh0 = _empty_state(q) if dh0 is None or h0 is None else dh0.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.float(), dh0


@torch.library.register_fake("elastic_ssm::gla_chunk_bwd", lib=_LIB)
def _(q, k, v, g_cumsum, h0, A, do, dht, scale):
    dh0 = _empty_state(q) if h0 is None else torch.empty_like(h0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(g_cumsum, dtype=torch.float32), dh0)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, h0, scale, output_final_state = inputs
    _, _, A, g_cumsum = output
    ctx.save_for_backward(q, k, v, g_cumsum, h0, A)
    ctx.scale, ctx.output_final_state, ctx.has_h0 = scale, output_final_state, h0 is not None


def _backward(ctx, do, dht, dA, dg_cumsum):
    q, k, v, g_cumsum, h0, A = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dh0 = gla_chunk_bwd(q, k, v, g_cumsum, h0, A, do, dht, ctx.scale)
    return dq, dk, dv, dg, (dh0 if ctx.has_h0 else None), None, None


gla_chunk_fwd, gla_chunk_bwd = torch.ops.elastic_ssm.gla_chunk_fwd, torch.ops.elastic_ssm.gla_chunk_bwd
torch.library.register_autograd("elastic_ssm::gla_chunk_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def head_bucket(H: int) -> int:
    """The head count fla's kernels see for ``H`` heads: the next power of two (``H`` itself when it is one), so
    capacity-mixed training autotunes at most ``log2(K-bar) + 1`` head counts (README.md, "Head count")."""
    b = 1
    while b < H:                      # comparisons, not int.bit_length: H may be a symbolic size under torch.compile
        b *= 2
    return b


def gla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float = 1.0, initial_state: Tensor | None = None,
              output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """Chunked GLA through fla (differentiable): ``o(t) = scale q(t)^T S(t)``, ``S(t) = diag(exp g(t)) S(t-1) +
    k(t) v(t)^T`` for q, k, g [B, T, H, Dk] (``g``: float32 natural-log decays), v [B, T, H, Dv] and ``S(0) =
    initial_state`` (float32 [B, H, Dk, Dv] or None) -> ``o [B, T, H, Dv]`` and ``S(T)`` float32 or None. The
    kernels run on ``head_bucket(H)`` heads and on Dk, Dv of at least ``MIN_WIDTH`` (zeros appended, sliced off)."""
    if g.dtype != torch.float32 or (initial_state is not None and initial_state.dtype != torch.float32):
        raise ValueError(f"gla_chunk: g and initial_state must be float32, got {g.dtype} and "
                         f"{None if initial_state is None else initial_state.dtype}")
    if q.shape != k.shape or q.shape != g.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"gla_chunk: q, k, g must be [B, T, H, Dk] and v [B, T, H, Dv], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(g.shape)}, {list(v.shape)}")
    H, Dk, Dv = q.shape[2], q.shape[3], v.shape[3]
    dh, dk, dv = head_bucket(H) - H, max(MIN_WIDTH - Dk, 0), max(MIN_WIDTH - Dv, 0)
    if dh or dk or dv:                # zeros: q = k = v = 0, g = 0 keep S = 0 and o = 0 there; sliced off below
        q, k, g, v = (F.pad(x, (0, w, 0, dh)) for x, w in ((q, dk), (k, dk), (g, dk), (v, dv)))
        initial_state = None if initial_state is None else F.pad(initial_state, (0, dv, 0, dk, 0, dh))
    o, ht, _, _ = gla_chunk_fwd(q, k, v, g, initial_state, float(scale), output_final_state)
    return o[:, :, :H, :Dv], (ht[:, :H, :Dk, :Dv] if output_final_state else None)
