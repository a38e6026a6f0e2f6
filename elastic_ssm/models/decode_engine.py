"""The decoders ``generate`` uses: ``FastDecoder``s pooled per (tier, batch bucket), captured once on CUDA, and
``FusedSession`` (the pooled decoder, the prompt's prefill, attended spans above ``SPAN_MIN_BATCH`` rows).
docs/performance.md, "``generate`` is fast by default"."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch

from ..elastic.slicing import has_float_weight
from ..elastic.tiers import check_counts
from ..ops.swa_decode import MAX_TRITON_BATCH
from .compile import GRAPH_TOKENS, PrefillGraph, compiled_trunk, length_bucket
from .fast_decode import FastDecoder

__all__ = ["DecoderPool", "FusedSession", "decoder_pool", "batch_bucket", "use_fast_decoding", "SPAN_MIN_BATCH"]

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
