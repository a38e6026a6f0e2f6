"""Fused whole-model decoding of an ESSH tier: static buffers, one step function, optional CUDA graph.

``FastDecoder(model, tier, batch)`` evaluates exactly what ``ESSH.step`` evaluates (ESSH paper
Algorithm 4, Appendix O.3) with fewer, fatter kernels and no host synchronisation. Up to
``ops.gemv.MAX_FUSED_BATCH`` rows (``gemv="auto"``) the residual stream is a float32 buffer and a block is

* spectral: one product of the retained ``in_proj`` prefix (values, write, read and clock rows of all K_T
  channels, ``[K_T (P + 3m), d]``) with the pre-norm folded in (``ops.gemv.norm_gemv``) -> one fused
  recurrent kernel (``ops/spectral_scan/decode_triton.py``: blend Eq. 23, gates C.2, clock, state update
  Eq. 5 of all retained modes, readout, zero-lag correction Eq. 24, K^{-1/2}) -> ``out_proj`` product
  added into the residual stream (``ops.gemv.gemv_accumulate``, split over its input rows);
* sliding-window attention: QKV product with the pre-norm folded in -> one split-window kernel pair
  (``ops.swa_decode``: RoPE from the device positions, ring write, online softmax, combine) -> output
  product added into the residual stream;
* FFN: one product of the ``[2 n_ff, d]`` prefix with the pre-norm folded in and silu(gate)*up in its
  epilogue (``ops.gemv.norm_swiglu_gemv``) -> down product added into the residual stream;

then the final norm folded into the tied head. Larger batches are matrix products: the residual stream
stays in the embedding dtype and cuBLAS does the products (``gemv="cublas"``), with the same recurrent and
window kernels.

Weights are prefix *views* of the model's parameters (no copies; the tier is cut by
``elastic.slicing.prefix``). Fixed modal constants (rho, cos/sin theta, kc, ks, a kc, biases, beta) are
precomputed in the state dtype when the decoder is built ("cached at tier load", O.3). Caches are an
``ESSHCache`` whose tensors stay at fixed addresses, so one whole decode step can be captured in a CUDA
graph (``capture()``); ``step(tokens)`` then copies the tokens in, replays, and returns the static logits
buffer (clone it to keep it past the next step). Recurrent state in ``state_dtype`` (float32 default),
logits in the embedding dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..elastic.slicing import prefix
from ..ops.gemv import MAX_FUSED_BATCH, gemv_accumulate, norm_gemv, norm_swiglu_gemv
from ..ops.pdl import resolve_pdl
from ..ops.rope import rope_inv_freq
from ..ops.spectral_scan.decode_triton import (
    ModalConstants,
    resolve_backend,
    rms_norm,
    spectral_decode_step,
    swiglu,
)
from ..ops.swa_decode import swa_decode_step
from .cache import ESSHCache

__all__ = ["FastDecoder"]


@dataclass
class _Layer:
    kind: str                       # 'S' spectral or 'A' sliding-window attention
    norm1: torch.Tensor             # [D]
    norm2: torch.Tensor             # [D]
    w_in: torch.Tensor              # S: [K(P+3M), D]; A: qkv [3D, D]
    w_out: torch.Tensor             # S: [K P, D] (in x out); A: out^T [D, D] (in x out)
    ffn_in: torch.Tensor            # [2 n_ff, D] rows (gate_h, up_h)
    ffn_out: torch.Tensor           # [n_ff, D]
    consts: ModalConstants | None   # S only
    w_out_rows: torch.Tensor | None     # mixer output weight, out x in: A: out [D, D] (a view);
                                        # S: a [D, K P] copy with out_layout='rows', else None
    ffn_out_rows: torch.Tensor | None   # FFN down weight, out x in: a [D, n_ff] copy with out_layout='rows'


def _residual_mm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x + a @ w with the add in the GEMM epilogue when dtypes agree. x [B,D], a [B,N], w [N,D]."""
    if x.dtype == w.dtype and a.dtype == w.dtype:
        return torch.addmm(x, a, w)
    return x + (a.to(w.dtype) @ w).to(x.dtype)


class FastDecoder:
    """Static-buffer, host-sync-free decoder of ``model`` at ``tier`` for ``batch`` sequences.

    ``cache``: an ``ESSHCache`` of this tier and batch (e.g. after a prefill); allocated if None.
    ``backend``: 'auto' | 'triton' | 'torch' for the fused kernels. ``attention``: 'auto' (SDPA on CUDA,
    the explicit masked-softmax of ``SlidingWindowAttention.step`` elsewhere) | 'sdpa' | 'math' (the torch
    path of the window step). ``gemv``: 'auto' (fused products up to batch 8) | 'fused' | 'cublas'.
    ``out_layout`` of the fused path's spectral out- and FFN down-products: 'split' reads the model's
    input-by-output weights in place, split over their rows with float32 atomics; 'rows' keeps a
    transposed contiguous copy of those weights for the tier (extra memory: their size, 0.86 GB for 1.5b
    T10 in bf16) and streams them with the row kernel, each output owned by one program (deterministic
    summation, and with PDL the whole weight slab of a program is read before it waits); 'auto'
    (default) = 'rows' with PDL, else 'split' (the faster of the two on an H200 in each case,
    docs/benchmarks.md).
    ``pdl``: launch the Triton kernels with programmatic dependent launch (``ops/pdl.py``): each kernel
    starts streaming its weights while the previous one finishes. 'auto' (default) = on for CUDA devices
    of compute capability >= 9.0 with the Triton backend; True / False force it.
    """

    def __init__(self, model, tier: Any = None, batch: int = 1, cache: ESSHCache | None = None,
                 state_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                 backend: str = "auto", attention: str = "auto", gemv: str = "auto",
                 out_layout: str = "auto", pdl: bool | str = "auto", cuda_graph: bool = False) -> None:
        cfg = model.config
        self.model, self.config = model.eval(), cfg
        self.tier = model.resolve_tier(tier)
        emb = model.embed.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.backend = resolve_backend(backend, self.device)
        self.pdl = resolve_pdl(pdl, self.device) and self.backend == "triton"
        if attention not in ("auto", "sdpa", "math"):
            raise ValueError(f"attention must be 'auto', 'sdpa' or 'math', got {attention!r}")
        if attention == "auto":
            attention = "sdpa" if self.device.type == "cuda" else "math"
        self.attention = attention
        if cache is None:  # ESSHCache.allocate resolves the default dtypes (bf16 KV on CUDA only)
            cache = model.allocate_cache(batch, self.tier, state_dtype=state_dtype, kv_dtype=kv_dtype)
        if cache.batch != batch or cache.tier != self.tier:
            raise ValueError(f"cache is for batch {cache.batch} at {cache.tier.name}; the decoder needs "
                             f"batch {batch} at {self.tier.name}: allocate it with "
                             "model.allocate_cache(batch, tier)")
        self.cache, self.batch = cache, batch
        if out_layout not in ("auto", "split", "rows"):
            raise ValueError(f"out_layout must be 'auto', 'split' or 'rows', got {out_layout!r}")
        self.out_layout = ("rows" if self.pdl else "split") if out_layout == "auto" else out_layout
        if gemv not in ("auto", "fused", "cublas"):
            raise ValueError(f"gemv must be 'auto', 'fused' or 'cublas', got {gemv!r}")
        self.fused_gemv = gemv == "fused" or (gemv == "auto" and batch <= MAX_FUSED_BATCH)
        state_dt = next(iter(cache.states.values())).dtype if cache.states else torch.float32
        self.layers = [self._plan(block, state_dt) for block in model.blocks]
        self.head = emb if model.lm_head is None else model.lm_head.weight
        self.norm_f, self.eps = model.norm_f.weight, model.norm_f.eps
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_base, self.device)
        self._tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._x = torch.zeros(batch, cfg.d_model, dtype=torch.promote_types(self.dtype, torch.float32),
                              device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        if cuda_graph:
            self.capture()

    # ---- tier load ------------------------------------------------------------------------------------
    @property
    def _row_copies(self) -> bool:
        return self.out_layout == "rows" and self.fused_gemv

    def _plan(self, block, state_dtype: torch.dtype) -> _Layer:
        t, D = self.tier, self.config.d_model
        ffn_in = prefix(block.ffn.w_in, t.n_ff).reshape(2 * t.n_ff, D)
        ffn_out = prefix(block.ffn.w_out, t.n_ff)
        if block.kind == "S":
            mx = block.mixer
            w_in = prefix(mx.in_proj, t.K).reshape(t.K * (mx.P + 3 * mx.M), D)
            w_out = prefix(mx.out_proj, t.K).reshape(t.K * mx.P, D)
            consts = ModalConstants.from_mixer(mx, t.K, state_dtype)
            rows = w_out.t().contiguous() if self._row_copies else None
        else:
            w_in, w_out, consts, rows = block.mixer.qkv, block.mixer.out.t(), None, block.mixer.out
        ffn_rows = ffn_out.t().contiguous() if self._row_copies else None
        return _Layer(block.kind, block.norm1.weight, block.norm2.weight, w_in, w_out, ffn_in, ffn_out,
                      consts, rows, ffn_rows)

    # ---- one step ---------------------------------------------------------------------------------------
    def _attend(self, i: int, qkv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """qkv [B, 3D] -> attention output [B, D] (RoPE, ring write, window softmax: ``ops.swa_decode``)."""
        c = self.cache
        return swa_decode_step(qkv, c.keys[i], c.values[i], c.slot_pos, c.positions, self.inv_freq,
                               self.backend, self.attention, out_dtype, pdl=self.pdl)

    def _step_impl(self) -> torch.Tensor:
        return self._step_fused() if self.fused_gemv else self._step_cublas()

    def _step_cublas(self) -> torch.Tensor:
        """Batched step: residual stream in the embedding dtype, cuBLAS products (any batch)."""
        c, be = self.cache, self.backend
        x = F.embedding(self._tokens, self.model.embed.weight)            # [B, D]
        for i, L in enumerate(self.layers):
            u = rms_norm(x, L.norm1, self.eps, be)
            if L.kind == "S":
                z = spectral_decode_step(F.linear(u, L.w_in), c.states[i], L.consts, L.w_out.dtype, be)
                x = _residual_mm(x, z, L.w_out)
            else:
                x = _residual_mm(x, self._attend(i, F.linear(u, L.w_in), x.dtype), L.w_out)
            a = swiglu(F.linear(rms_norm(x, L.norm2, self.eps, be), L.ffn_in), be)
            x = _residual_mm(x, a, L.ffn_out)
        c.positions.add_(1)
        return F.linear(rms_norm(x, self.norm_f, self.eps, be), self.head)

    def _add_product(self, a: torch.Tensor, w: torch.Tensor, w_rows: torch.Tensor | None,
                     x: torch.Tensor) -> None:
        """x += a @ w, from the out x in copy ``w_rows`` when the decoder keeps one, else split over rows."""
        if w_rows is not None:
            norm_gemv(a, w_rows, out=x, residual=True, backend=self.backend, pdl=self.pdl)
        else:
            gemv_accumulate(a, w, x, backend=self.backend, pdl=self.pdl)

    def _step_fused(self) -> torch.Tensor:
        """Small-batch step (``ops.gemv``): float32 residual stream ``self._x``; every pre-norm folded into
        the next product, SwiGLU into the FFN input product, residual adds into the output products."""
        c, be, eps, x, pdl = self.cache, self.backend, self.eps, self._x, self.pdl
        x.copy_(F.embedding(self._tokens, self.model.embed.weight))       # [B, D] float32
        for i, L in enumerate(self.layers):
            if L.kind == "S":
                h = norm_gemv(x, L.w_in, L.norm1, eps, backend=be, pdl=pdl)           # [B, K(P+3M)]
                z = spectral_decode_step(h, c.states[i], L.consts, x.dtype, be, pdl=pdl)
                self._add_product(z, L.w_out, L.w_out_rows, x)
            else:
                o = self._attend(i, norm_gemv(x, L.w_in, L.norm1, eps, backend=be, pdl=pdl), x.dtype)
                norm_gemv(o, L.w_out_rows, out=x, residual=True, backend=be, pdl=pdl)
            a = norm_swiglu_gemv(x, L.ffn_in, L.norm2, eps, backend=be, pdl=pdl)
            self._add_product(a, L.ffn_out, L.ffn_out_rows, x)
        c.positions.add_(1)
        return norm_gemv(x, self.head, self.norm_f, eps, out_dtype=self.dtype, backend=be, pdl=pdl)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> logits [B, V]; advances the cache by one token. With a captured graph the result
        is a static buffer overwritten by the next call."""
        if tokens.shape != (self.batch,):
            raise ValueError(f"tokens must have shape ({self.batch},), got {tuple(tokens.shape)}")
        self._tokens.copy_(tokens, non_blocking=True)
        if self._graph is not None:
            self._graph.replay()
            return self._logits
        return self._step_impl()

    # ---- CUDA graph --------------------------------------------------------------------------------------
    def _snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cache
        tensors = [*c.states.values(), *c.keys.values(), *c.values.values(), c.slot_pos, c.positions]
        return [(t, t.clone()) for t in tensors]

    @torch.no_grad()
    def capture(self, warmup: int = 2, preserve_cache: bool = True) -> None:
        """Capture one whole decode step in a CUDA graph (after ``warmup`` eager steps on a side stream,
        which compile Triton kernels and create cuBLAS handles). With ``preserve_cache`` the cache is
        restored afterwards, so the next ``step`` continues exactly where the cache stood."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA-graph capture needs the model on a CUDA device")
        saved = self._snapshot() if preserve_cache else []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step_impl()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self._step_impl()
        for t, copy in saved:
            t.copy_(copy)
        self._graph = graph

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    def state_nbytes(self) -> dict[str, int]:
        """Persistent bytes held for the batch (recurrent states + KV ring; bookkeeping excluded)."""
        return self.cache.nbytes()
