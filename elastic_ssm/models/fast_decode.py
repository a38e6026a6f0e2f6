"""Fused whole-model decoding of an ESSH tier (ESSH Algorithm 4, Appendix O.3): static buffers, CUDA graph.

``FastDecoder(model, tier, batch)`` evaluates what ``ESSH.step`` evaluates through each layer's ``decode_plan``
(``layers/decode_plan.py``) on the residual stream [B, D]; its cache is an ``ESSHCache`` at fixed addresses, so
one step can be captured (``capture()``). ``generate``'s decoders: ``FastDecoder``s pooled per (tier, batch bucket),
captured once on CUDA, and ``FusedSession`` (the pooled decoder, the prompt's prefill, attended spans above
``SPAN_MIN_BATCH`` rows). Kernels, attended spans, mixed tiers, pooling: docs/performance.md."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..elastic.slicing import has_float_weight, write_row_factors
from ..elastic.tiers import check_counts
from ..layers.decode_plan import DecodeOptions
from ..ops.dispatch import resolve_decode_backend
from ..ops.gemv import MAX_FUSED_BATCH, norm_gemv, resolve_pdl, rms_norm
from ..ops.swa_decode import MAX_TRITON_BATCH
from .cache import ESSHCache
from .compile import GRAPH_TOKENS, PrefillGraph, capture_graph, compiled_trunk, length_bucket

__all__ = ["FastDecoder", "DecoderPool", "FusedSession", "decoder_pool", "batch_bucket", "use_fast_decoding",
           "SPAN_MIN_BATCH"]


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


#: generate passes attended spans above this batch (the Triton window kernels up to it skip empty slots anyway)
SPAN_MIN_BATCH = MAX_TRITON_BATCH


def batch_bucket(batch: int) -> int:
    """The captured batch size serving ``batch`` rows: the next power of two."""
    check_counts(batch=batch)
    return 1 << (batch - 1).bit_length()


def use_fast_decoding(model, fast: bool | None) -> bool:
    """``fast=None`` or True: the fused decoder (CUDA-graphed on CUDA, its torch path on the CPU); False: the
    reference step. A model with replaced or quantized ``nn.Linear`` weights (quantization, LoRA) takes the
    reference step under ``fast=None``; ``fast=True`` is then a ValueError (docs/architecture.md)."""
    if fast not in (True, False, None):
        raise ValueError(f"fast must be True, False or None (automatic), got {fast!r}")
    if fast is False:
        return False
    replaced = next((n for n, m in model.named_modules() if hasattr(m, "in_features") and not has_float_weight(m)),
                    None)
    if replaced is not None and fast:
        module = model.get_submodule(replaced)          # package.Class, and its weight's when a tensor subclass
        w = getattr(module, "weight", None)
        kind = f"{type(module).__module__}.{type(module).__qualname__}" + (
            f" with a {type(w.data).__qualname__} weight" if isinstance(w, torch.Tensor) else "")
        raise ValueError(f"fast=True: the fused decoder reads nn.Linear weights, but {replaced} is a {kind}; use "
                         "fast=None or False (the reference step runs replaced modules)")
    return replaced is None


class DecoderPool:
    """Least-recently-used pool of ``FastDecoder``s of one model, keyed by (tier, bucket, cache dtypes). Decoders
    and prefill graphs are built outside inference mode and without gradients: their tensors are then ordinary
    ones, which a later ``generate`` outside ``torch.inference_mode`` may still write in place."""

    def __init__(self, model, max_decoders: int = 4) -> None:
        self._model, self.max_decoders = weakref.ref(model), max_decoders
        self._decoders: OrderedDict[tuple, FastDecoder] = OrderedDict()
        self._prefills: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._graph_pool = None               # one CUDA memory pool for all prefill graphs (never concurrent)
        self.max_prefills = 4
        self.min_span = 128                   # smallest attended span of the decoders (FastDecoder)
        self._signature: tuple | None = None
        self.captures = 0                     # graphs captured so far (tests check reuse with it)
        self.eager_graphs = True              # graphs of an eager model's prefill (off after a capture fails)

    @torch.inference_mode(False)
    @torch.no_grad()
    def get(self, tier: Any, batch: int, state_dtype: torch.dtype | None = None,
            kv_dtype: torch.dtype | None = None) -> FastDecoder:
        """The decoder serving ``batch`` rows at ``tier`` (built and captured on first use)."""
        model = self._model()
        t = model.resolve_tier(tier)
        sig = tuple((id(p), p._version) for p in model.parameters())     # weights replaced or edited in place
        if sig != self._signature:
            self.clear()
            self._signature = sig
        bucket = batch_bucket(batch)
        key = (t.name, bucket, state_dtype, kv_dtype)
        fd = self._decoders.get(key)
        if fd is not None:
            self._decoders.move_to_end(key)
            return fd
        shared = next((d for (name, *_), d in self._decoders.items() if name == t.name), None)
        fd = FastDecoder(model, t, bucket, state_dtype=state_dtype, kv_dtype=kv_dtype, share_plans=shared,
                         min_span=self.min_span)
        if model.embed.weight.device.type == "cuda":
            try:
                fd.capture(preserve_cache=False, spans=bucket > SPAN_MIN_BATCH)
                self.captures += 1
            except RuntimeError as e:   # e.g. a kernel that cannot be captured on this stack: stay eager
                warnings.warn(f"CUDA-graph capture of the decoder failed ({e}); decoding without a graph", stacklevel=3)
        self._decoders[key] = fd
        while len(self._decoders) > self.max_decoders:
            old = self._decoders.popitem(last=False)[1]
            for k in [k for k, p in self._prefills.items() if p.cache is old.cache]:
                del self._prefills[k]
        return fd

    @torch.inference_mode(False)
    @torch.no_grad()
    def prefill_graph(self, fd: FastDecoder, length: int, padded: bool, graph: bool = True) -> PrefillGraph:
        """The prefill graph of decoder ``fd`` for prompts of ``length`` tokens (captured on first use)."""
        key = (id(fd), length, padded)
        pg = self._prefills.get(key)
        if pg is not None and pg.cache is fd.cache:
            self._prefills.move_to_end(key)
            return pg
        if graph and self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        pg = PrefillGraph(self._model(), fd.cache, length, padded, graph=graph, pool=self._graph_pool)
        self._prefills[key] = pg
        while len(self._prefills) > self.max_prefills:
            self._prefills.popitem(last=False)
        return pg

    def clear(self) -> None:
        self._decoders.clear()
        self._prefills.clear()
        self._graph_pool = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def info(self) -> list[dict]:
        """One row per pooled decoder: tier, bucket, graphed, cache bytes."""
        return [{"tier": k[0], "bucket": k[1], "graphed": d.graphed, "cache_bytes": d.cache.nbytes()["total"]}
                for k, d in self._decoders.items()]


class FusedSession:
    """``generate``'s fused path: the pooled decoder of the batch bucket; prefill into its cache, from a prefill
    graph of the prompt's length bucket on CUDA (``uses_prefill_graph``), else eagerly."""

    def __init__(self, model, batch: int, tier: Any, state_dtype, kv_dtype) -> None:
        self.model, self.pool = model, decoder_pool(model)
        self.fd = self.pool.get(tier, batch, state_dtype, kv_dtype)
        self.spans = self.fd.batch > SPAN_MIN_BATCH and bool(self.fd.spans)
        self.length = 0                       # the prompt's padded length + steps: no row is longer

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's step (tokens [B] -> logits [B, V]), over the attended span of the rows' length."""
        self.length += 1
        return self.fd.step(tokens, span=self.length if self.spans else None)

    def uses_prefill_graph(self, length: int | None = None) -> bool:
        """Whether a prompt of ``length`` tokens is prefilled from a CUDA graph: on CUDA, always for a compiled
        model; for an eager one while its padded tokens (batch bucket x length bucket) are at most
        ``GRAPH_TOKENS`` (the server's rule, ``serve/slots.py``)."""
        if self.fd.device.type != "cuda":
            return False
        if compiled_trunk(self.model) is not None:
            return True
        return self.pool.eager_graphs and length is not None and self.fd.batch * length_bucket(length) <= GRAPH_TOKENS

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, graph: bool = True) -> torch.Tensor:
        """Prompt [B, T] -> logits of its last position [B, V]; fills the first B rows of the cache.
        ``graph=False`` runs the prefill-graph function without capturing it (how the CPU tests check it)."""
        B, T = input_ids.shape
        self.length = T
        if self.uses_prefill_graph(T) or not graph:
            L = length_bucket(T)
            padded = attention_mask is not None or L != T
            try:
                return self.pool.prefill_graph(self.fd, L, padded, graph=graph)(input_ids, attention_mask)
            except Exception as e:   # a kernel that cannot be captured on this stack: an eager model goes on eagerly
                if compiled_trunk(self.model) is not None or not graph:
                    raise
                self.pool.eager_graphs = False
                warnings.warn(f"capturing a prefill graph failed ({type(e).__name__}: {e}); prefilling eagerly from "
                              "now on", stacklevel=3)
        cache = self.fd.cache.reset_().narrow(B)
        h = self.model.hidden_states(input_ids, tier=self.fd.tier, attention_mask=attention_mask, cache=cache)
        return self.model.logits_from_hidden(h[:, -1])


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_pool(model) -> DecoderPool:
    """The model's pool, created on first use. Held beside the model (a weak-keyed table), not in it, so
    copying, pickling or saving a model never touches captured graphs."""
    if model not in _POOLS:
        _POOLS[model] = DecoderPool(model)
    return _POOLS[model]
