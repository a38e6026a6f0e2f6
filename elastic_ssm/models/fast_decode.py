"""Fused whole-model decoding of an ESSH tier (ESSH Algorithm 4, Appendix O.3): static buffers, CUDA graph.

``FastDecoder(model, tier, batch)`` evaluates what ``ESSH.step`` evaluates through each layer's ``decode_plan``
(``layers/decode_plan.py``) on the residual stream [B, D]; its cache is an ``ESSHCache`` at fixed addresses, so
one step can be captured (``capture()``). Kernels, attended spans, mixed tiers: docs/performance.md."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..elastic.slicing import write_row_factors
from ..elastic.tiers import check_counts
from ..layers.decode_plan import DecodeOptions
from ..ops.dispatch import resolve_decode_backend
from ..ops.gemv import MAX_FUSED_BATCH, norm_gemv, resolve_pdl, rms_norm
from .cache import ESSHCache
from .compile import capture_graph

__all__ = ["FastDecoder"]


class FastDecoder:
    """Static-buffer, host-sync-free decoder of ``model`` at ``tier`` for ``batch`` sequences.

    ``cache``: an ``ESSHCache`` of this tier and batch (allocated if None). ``backend``: 'auto' | 'triton' |
    'torch'. ``attention``: 'auto' (SDPA on CUDA, else 'math') | 'sdpa' | 'math'. ``gemv``: 'auto' (fused up to
    ``MAX_FUSED_BATCH``) | 'fused' | 'cublas'. ``out_layout``: 'rows' (weights in place, deterministic) | 'split'
    (an in-by-out copy, float32 atomics) | 'auto' ('split' for Triton without PDL). ``pdl``: ``ops/gemv``.
    ``share_plans``: a decoder whose plans this one reuses when tier, state dtype and layout agree.
    ``min_span``: the smallest attended span (ring slots). ``mixed``: rows may run at tiers nested in ``tier``."""

    def __init__(self, model, tier: Any = None, batch: int = 1, cache: ESSHCache | None = None,
                 state_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                 backend: str = "auto", attention: str = "auto", gemv: str = "auto",
                 out_layout: str = "auto", pdl: bool | str = "auto", cuda_graph: bool = False,
                 share_plans: FastDecoder | None = None, min_span: int = 128, mixed: bool = False) -> None:
        cfg = model.config
        self.model, self.config = model.eval(), cfg
        self.tier = model.resolve_tier(tier)
        emb = model.embed.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.backend = resolve_decode_backend(backend, self.device)
        pdl_on = resolve_pdl(pdl, self.device) and self.backend == "triton"
        if attention not in ("auto", "sdpa", "math"):
            raise ValueError(f"attention must be 'auto', 'sdpa' or 'math', got {attention!r}")
        if attention == "auto":
            attention = "sdpa" if self.device.type == "cuda" else "math"
        self.options = DecodeOptions(self.backend, pdl_on, attention)
        self.row_tiers = [self.tier] * batch            # every row's own tier (``set_row_tier``; mixed only)
        if mixed:                                       # factors of every row at the decoder's tier (all ones)
            rows = model.row_tiers(self.row_tiers, self.tier)
            self.options = replace(self.options, channel_scale=rows.channel_scale, unit_mask=rows.unit_mask)
        if cache is None:  # ESSHCache.allocate resolves the default dtypes (bf16 KV on CUDA only)
            cache = model.allocate_cache(batch, self.tier, state_dtype=state_dtype, kv_dtype=kv_dtype)
        if cache.batch != batch or cache.tier != self.tier:
            raise ValueError(f"cache is for batch {cache.batch} at {cache.tier.name}; the decoder needs "
                             f"batch {batch} at {self.tier.name}: allocate it with "
                             "model.allocate_cache(batch, tier)")
        self.cache, self.batch = cache, batch
        check_counts(min_span=min_span)
        if out_layout not in ("auto", "split", "rows"):
            raise ValueError(f"out_layout must be 'auto', 'split' or 'rows', got {out_layout!r}")
        if out_layout == "auto":
            out_layout = "split" if self.backend == "triton" and not pdl_on else "rows"
        self.out_layout = out_layout
        if gemv not in ("auto", "fused", "cublas"):
            raise ValueError(f"gemv must be 'auto', 'fused' or 'cublas', got {gemv!r}")
        self.fused_gemv = gemv == "fused" or (gemv == "auto" and batch <= MAX_FUSED_BATCH)
        state_dt = next(iter(cache.states.values())).dtype if cache.states else torch.float32
        split = self.out_layout == "split" and self.fused_gemv
        self._plan_key = (self.tier, state_dt, split)
        if share_plans is not None and share_plans.model is model and share_plans._plan_key == self._plan_key:
            self.mixers, self.ffns = share_plans.mixers, share_plans.ffns
        else:
            self.mixers = [b.mixer.decode_plan(self.tier, state_dt, split_copy=split) for b in model.blocks]
            self.ffns = [b.ffn.decode_plan(self.tier, split_copy=split) for b in model.blocks]
        self.norms = [(b.norm1.weight, b.norm2.weight) for b in model.blocks]
        self.head = emb if model.lm_head is None else model.lm_head.weight
        self.norm_f, self.eps = model.norm_f.weight, model.norm_f.eps
        self._tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._x = torch.zeros(batch, cfg.d_model, dtype=torch.promote_types(self.dtype, torch.float32),
                              device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        has_ring = any(getattr(b, "kind", None) != "S" for b in model.blocks)
        lo = max(0, min_span - 1).bit_length()          # attended spans below the window: powers of two >= min_span
        self.spans = [1 << i for i in range(lo, (cfg.window - 1).bit_length())] if has_ring else []
        self._span_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if cuda_graph:
            self.capture()

    @property
    def pdl(self) -> bool:
        return self.options.pdl

    @property
    def mixed(self) -> bool:
        """Whether rows may run at different tiers (``set_row_tier``)."""
        return self.options.channel_scale is not None

    @torch.no_grad()
    def set_row_tier(self, row: int, tier: Any) -> None:
        """Make cache row ``row`` decode at ``tier`` (nested in the decoder's; ``mixed=True``) from the next step
        on; the row's two factors are written in place, so a captured graph stays valid."""
        t = self.model.resolve_tier(tier)
        if not self.mixed:
            if t != self.tier:
                raise ValueError(f"this decoder runs every row at {self.tier.name}; build it with mixed=True to "
                                 f"decode rows at other tiers (asked for {t.name})")
            return
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is outside the decoder's {self.batch} rows")
        # K^{-1/2} z of the widest K -> K_T^{-1/2} z (Sec. 4.1); ValueError for a tier wider than the decoder's
        write_row_factors(self.options.channel_scale[row], self.options.unit_mask[row], self.tier, t,
                          self.config.value_width, "the decoder's ", "build the decoder at the widest tier served")
        self.row_tiers[row] = t

    def _step_impl(self, span: int | None = None) -> torch.Tensor:
        """One step of the whole model -> logits [B, V]. ``span``: a bucket of ``self.spans`` (None: whole ring)."""
        o = self.options if span is None else replace(self.options, span=span)
        eps, layers = self.eps, zip(self.mixers, self.ffns, self.norms, self.cache.layers)
        if self.fused_gemv:
            x = self._x
            x.copy_(F.embedding(self._tokens, self.model.embed.weight))        # [B, D] float32
            for mixer, ffn, (n1, n2), state in layers:
                mixer.fused(x, n1, eps, state, o)
                ffn.fused(x, n2, eps, None, o)
            logits = norm_gemv(x, self.head, self.norm_f, eps, out_dtype=self.dtype, backend=o.backend, pdl=o.pdl)
        else:
            x = F.embedding(self._tokens, self.model.embed.weight)             # [B, D]
            for mixer, ffn, (n1, n2), state in layers:
                x = mixer.batched(x, n1, eps, state, o)
                x = ffn.batched(x, n2, eps, None, o)
            logits = F.linear(rms_norm(x, self.norm_f, eps, o.backend), self.head)
        self.cache.positions.add_(1)
        return logits

    def span_for(self, n: int | None) -> int | None:
        """The attended span serving rows of fewer than ``n`` tokens: the smallest bucket >= n, or None (the
        whole ring) when ``n`` is None or no bucket is that large."""
        return None if n is None else next((s for s in self.spans if s >= n), None)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, *, span: int | None = None) -> torch.Tensor:
        """tokens [B'] (the first B' <= batch cache rows) -> logits [B', V]; the whole cache advances by one.
        With a captured graph the result is a view of a static buffer that the next call overwrites. ``span``:
        every row read has position < span (docs/performance.md); None: no promise."""
        if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 1 \
                or not 1 <= tokens.shape[0] <= self.batch:
            raise ValueError(f"tokens must be integer ids of shape (B,) with 1 <= B <= {self.batch}, got "
                             f"{tokens.dtype} {tuple(tokens.shape)}")
        self.model.verified()                           # a deferred load's checksum: no output before it passes
        rows = tokens.shape[0]
        self._tokens[:rows].copy_(tokens, non_blocking=True)
        span = self.span_for(span)
        if self._graph is not None:
            graph, logits = self._span_graphs.get(span, (self._graph, self._logits))
            graph.replay()
            return logits[:rows]
        return self._step_impl(span)[:rows]

    @torch.no_grad()
    def capture(self, warmup: int = 2, preserve_cache: bool = True, spans: bool = False) -> None:
        """Capture one decode step in a CUDA graph after ``warmup`` eager steps on a side stream (Triton
        compiles, cuBLAS handles). ``preserve_cache``: the cache is restored afterwards. ``spans``: also one graph
        per attended span of ``self.spans`` (one memory pool), for ``step(tokens, span=...)``."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA-graph capture needs the model on a CUDA device")
        saved = [(t, t.clone()) for t in self.cache.tensors()] if preserve_cache else []
        pool = torch.cuda.graph_pool_handle() if spans and self.spans else None
        graphs = {span: capture_graph(partial(self._step_impl, span), warmup, pool)
                  for span in [None, *(self.spans if spans else [])]}
        for t, copy in saved:
            t.copy_(copy)
        self._graph, self._logits = graphs.pop(None)
        self._span_graphs = graphs

    @property
    def graphed(self) -> bool:
        return self._graph is not None
