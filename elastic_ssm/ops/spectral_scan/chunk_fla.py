"""GPU path of the ESSH scan through fla-core's ``chunk_gla`` (the GLA identity of DESIGN.md / README.md).

Per channel k (a GLA head) and mode i (key dimensions ``2i, 2i+1``), positions ``t = 1..T``::

    q_i(t) = eta^r_i(t) R(-theta_i t) kappa_i              kappa_i = (kc_i, -ks_i)
    k_i(s) = eta^w_i(s) (cos theta_i s, -sin theta_i s)    = eta^w_i(s) R(-theta_i s) e1
    g_i(t) = log rho_i - Delta_i(t)                        on both key dimensions of mode i
    o(t)   = q(t)^T S(t),  S(t) = diag(exp g(t)) S(t-1) + k(t) v(t)^T,  scale 1

The GLA state is ``S_i(t) = R(-theta_i t) H_i(t)``; phases ``theta t mod 2 pi`` in float64; the zero-lag
correction (Eq. 24) is added outside the kernel. The mapping is pure torch, tested on CPU in float64.

fla-core's chunked GLA kernels run as two torch ops (``elastic_ssm::gla_chunk_fwd`` / ``_bwd``), so ``torch.compile``
traces around them; fla is imported when an op first runs. README.md, section on the fla path. Declared with
``torch.library.Library``: ``torch.library.custom_op`` runs each call through ``torch._disable_dynamo``, whose first
call imports ``torch._dynamo`` (1-2 s of a fresh process's first prefill, docs/performance.md)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dispatch import import_fla_chunk
from .chunk_torch import _decay_scan, _rotated_frame, _rotation
from .inputs import ModalTables, capped_log_decay, isolate_nonfinite, isolating, restore_nonfinite
from .naive import naive_spectral_scan

GRAD_SEGMENT = 256   # with a theta gradient: segments of at most this many tokens (fla_spectral_scan)
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


def _absolute_phase(theta: torch.Tensor, T: int, period: int | None = None) -> torch.Tensor:
    """``theta t mod 2 pi`` for ``t = 1..T`` (with ``period`` L: t counted from each L-token segment's start, 1..L)
    in float64: ``[T, K, M]`` (differentiable in theta)."""
    t = torch.arange(T, dtype=torch.float64, device=theta.device)
    t = (t if period is None else torch.remainder(t, period)) + 1
    return torch.remainder(theta.double()[None] * t[:, None, None], 2 * math.pi)


def gla_inputs(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor, modal: ModalTables,
               initial_state: torch.Tensor | None = None, dtype: torch.dtype | None = None, period: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The scan's inputs (shapes of ``spectral_scan``; ``modal.a`` is used by gla_outputs) as GLA operands
    ``q, k [B, T, K, 2M]``, ``v [B, T, K, P]`` (in ``dtype``, default ``v.dtype``), ``g [B, T, K,
    2M]`` and ``h0 [B, K, 2M, P]`` (at least float32); key dimension ``2i + j`` is coordinate ``j`` of mode ``i``.
    With ``period`` L, the phases of q and k restart at each L-token segment (``_absolute_phase``)."""
    B, T, K, P = v.shape
    rho, theta, kc, ks, _ = modal
    M = rho.shape[-1]
    dtype = dtype or v.dtype
    wide = torch.promote_types(v.dtype, torch.float32)  # gates and tables before the final cast
    phase = _absolute_phase(theta, T, period)  # [T, K, M] float64
    cph, sph = torch.cos(phase).to(wide), torch.sin(phase).to(wide)
    qrot, krot = _rotated_frame(cph, sph, kc.to(wide), ks.to(wide))  # R(-theta t) kappa, R(-theta t) e1
    q = (read.to(wide)[..., None] * qrot).reshape(B, T, K, 2 * M).to(dtype)
    k = (write.to(wide)[..., None] * krot).reshape(B, T, K, 2 * M).to(dtype)
    # capped like the torch path (inputs.py): rho = 0 or an infinite clock is an exact reset (exp underflows to
    # 0 in fp32, also after fla's base-2 conversion), never -inf - (-inf) = NaN in fla's within-chunk cumsums
    g = -capped_log_decay(clock, rho, wide, wide)  # log rho - Delta, >= -cap
    g = g[..., None].expand(B, T, K, M, 2).reshape(B, T, K, 2 * M)
    h0 = None if initial_state is None else initial_state.to(wide).reshape(B, K, 2 * M, P)
    return q, k, v.to(dtype), g, h0


def gla_outputs(o: torch.Tensor, final_state: torch.Tensor | None, v: torch.Tensor, write: torch.Tensor,
                read: torch.Tensor, modal: ModalTables) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the GLA output ``o = q^T S`` [B, T, K, P], its state ``S(T)`` [B, K, 2M, P] (or None) and the scan's
    ``v, write, read, modal`` (theta, kc, a used): ``z = o - sum_i a_i r_i w_i kc_i v`` (Eq. 24) in ``v.dtype``
    and ``H(T) = R(theta T) S(T)`` or None."""
    B, T, K, P = v.shape
    theta, kc, a, M = modal.theta, modal.kc, modal.a, modal.theta.shape[-1]
    wide = torch.promote_types(v.dtype, torch.float32)
    corr = (read.to(wide) * write.to(wide) * (a * kc).to(wide)).sum(-1, keepdim=True)  # [B, T, K, 1]
    z = (o.to(wide) - corr * v.to(wide)).to(v.dtype)
    if final_state is None:
        return z, None
    rot = _rotation(theta.double() * T)  # [K, M, 2, 2], phase reduced mod 2 pi in float64
    S = final_state.reshape(B, K, M, 2, P)
    sdt = torch.promote_types(S.dtype, torch.float32)
    return z, torch.matmul(rot.to(sdt), S.to(sdt))  # [B, K, M, 2, P] natural frame


def _gla_scan(v, write, read, clock, modal, initial_state, output_final_state, compute_dtype):
    """One ``gla_chunk`` call over finite inputs (arguments of ``fla_spectral_scan``): ``(z, H(T) or None)``."""
    q, k, vv, g, h0 = gla_inputs(v, write, read, clock, modal, initial_state, compute_dtype)
    h0 = None if h0 is None else h0.float().contiguous()
    o, ht = gla_chunk(q, k, vv, g.float(), scale=1.0, initial_state=h0, output_final_state=output_final_state)
    return gla_outputs(o, ht if output_final_state else None, v, write, read, modal)


def _segment_scan(v, write, read, clock, modal, initial_state, output_final_state, compute_dtype, L):
    """The scan (arguments of ``fla_spectral_scan``, finite) as ``L``-token segments folded into the batch of one
    ``gla_chunk`` call, each from a zero state with phases from its own start (``period=L``). The states entering
    the segments, ``H_{j+1} = R(theta L_j) (F_j + diag(exp G_j(L_j)) H_j)`` (``F_j`` segment j's own final state,
    ``G_j(t)`` its log decay summed from its start through t), are a pure decay scan in the global frame
    ``R(-theta s_j) H_j`` (s_j: the tokens before segment j), run as chunk_torch's chunk boundaries are
    (``_decay_scan``); position t of segment j adds ``(q(t) * exp G_j(t))^T H_j``. ``(z, H(T) or None)``."""
    B, T, K, P = v.shape
    n, M, theta = -(-T // L), modal.theta.shape[-1], modal.theta.double()
    q, k, vv, g, h0 = gla_inputs(v, write, read, clock, modal, initial_state, compute_dtype, period=L)
    fold = lambda x: F.pad(x, (0, 0, 0, 0, 0, n * L - T)).reshape(B * n, L, K, x.shape[-1])  # noqa: E731 zeros: S kept
    q, g = fold(q), fold(g.float())
    o, fin = gla_chunk(q, k=fold(k), v=fold(vv), g=g, scale=1.0, output_final_state=True)
    G = g.view(B, n, L, K, 2 * M).cumsum(2)                                   # [B, n, L, K, 2M]; padding: g = 0
    starts = torch.arange(n, dtype=torch.float64, device=v.device) * L        # s_j
    to_global = _rotation(-theta[:, None, :] * starts[:, None]).float()       # [K, n, M, 2, 2]
    U = torch.matmul(to_global, fin.view(B, n, K, M, 2, P).transpose(1, 2))   # [B, K, n, M, 2, P]
    ell = -G[:, :, -1, :, ::2].double().permute(0, 2, 3, 1)                   # [B, K, M, n]: a mode's two keys alike
    h0 = None if h0 is None else h0.float().reshape(B, K, M, 2 * P)
    enter, last = _decay_scan(ell, U.transpose(2, 3).reshape(B, K, M, n, 2 * P), h0)
    enter = torch.matmul(to_global.mT, enter.reshape(B, K, M, n, 2, P).transpose(2, 3))  # [B, K, n, M, 2, P] natural
    wide = torch.promote_types(q.dtype, torch.float32)
    o_in = torch.einsum("bjlkm,bkjmp->bjlkp", q.view(B, n, L, K, 2 * M).to(wide) * G.exp().to(wide),
                        enter.reshape(B, K, n, 2 * M, P).to(wide))
    o = (o.view(B, n, L, K, P).to(wide) + o_in).reshape(B, n * L, K, P)[:, :T]
    z = gla_outputs(o, None, v, write, read, modal)[0]
    return z, (torch.matmul(_rotation(theta * T).float(), last.view(B, K, M, 2, P)) if output_final_state else None)


def fla_spectral_scan(v: torch.Tensor, write: torch.Tensor, read: torch.Tensor, clock: torch.Tensor,
                      modal: ModalTables, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                      compute_dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scan (shapes of ``spectral_scan``) through fla's chunked GLA kernels (CUDA; differentiable): ``z`` in
    ``v.dtype``, the state in float32. ``q, k, v`` go to the kernel in ``compute_dtype`` (default float32 also for
    bf16 inputs: an accurate theta gradient; None: ``v.dtype``). With a theta gradient, ``GRAD_SEGMENT``-token segments
    with phases from their own starts (``_segment_scan``): ``d theta = sum_t t d phase_t`` then scales fla's (TF32)
    dq, dk errors by at most that, not T."""
    if (T := v.shape[1]) == 0:
        return naive_spectral_scan(v, write, read, clock, *modal, initial_state, output_final_state)
    z_bad = state_bad = None
    if isolating(v):     # once for the whole sequence: the segments see finite inputs
        v, write, read, clock, initial_state, z_bad, state_bad = isolate_nonfinite(v, write, read, clock, initial_state)
    args = (v, write, read, clock, modal, initial_state, output_final_state, compute_dtype)
    segmented = T > GRAD_SEGMENT and torch.is_grad_enabled() and modal.theta.requires_grad
    z, state = _segment_scan(*args, GRAD_SEGMENT) if segmented else _gla_scan(*args)
    return restore_nonfinite(z, state, z_bad, state_bad)
