"""Compiling the ESSH trunk (``ESSH._trunk``: embedding, blocks, final norm, logits) and resolving its scan backend
eagerly. Graphs are cached under ``TORCHINDUCTOR_CACHE_DIR`` (default ``~/.cache/elastic_ssm/inductor``). Also the
one CUDA-graph capture of the fused decoder's steps and of the prefill graphs (``capture_graph``).

Prompt prefill replayed from a CUDA graph per (decoder, length bucket), ``PrefillGraph``: the trunk (compiled when
``compile_model`` was called) into a cache, the last position's logits. Prompts are left-padded to
``length_bucket``; extra rows of the batch bucket repeat the first. docs/performance.md, "Graphed compiled prefill"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..ops import resolve_backend
from .cache import ESSHCache
from .generation import token_positions

__all__ = ["compile_model", "compile_trunk", "compiled_trunk", "scan_backend", "trunk_for", "compile_cache_dir",
           "capture_graph", "PrefillGraph", "length_bucket", "GRAPH_TOKENS"]

log = logging.getLogger("elastic_ssm")


def compile_cache_dir() -> Path:
    """Where torch keeps compiled graphs (``TORCHINDUCTOR_CACHE_DIR``, else ``~/.cache/elastic_ssm/inductor``)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip()
    return Path(env) if env else Path.home() / ".cache" / "elastic_ssm" / "inductor"


def _announcing(fn: Callable) -> Callable:
    """``fn`` that logs, at its first call in this process, that it compiles and where the cache is."""
    said: list[bool] = []

    def call(*args: Any, **kw: Any) -> Any:
        if not said:
            said.append(True)
            log.warning("compiling the model (once per input shape, tier and padding mode; "
                        "cached in %s, so a later process reuses it)", compile_cache_dir())
        return fn(*args, **kw)

    return call

_KEY = "_compiled_trunk"  # the model's __dict__ entry (not a submodule, not a parameter: a deep copy keeps it)


def compile_model(model: Any, **kw: Any) -> Any:
    """``torch.compile`` a model in place and return it: an ESSH's whole trunk (:func:`compile_trunk`), other
    models block by block; ``kw`` goes to ``torch.compile`` (default ``dynamic=False``)."""
    if hasattr(model, "compile_forward"):
        return model.compile_forward(**kw)
    kw.setdefault("dynamic", False)
    for block in getattr(model, "blocks", []):
        block.compile(**kw)
    return model


def prepare_dynamo(limit: int) -> None:
    """``ops.dispatch.prepare_compile`` and dynamo's recompile limit raised to at least ``limit`` graphs."""
    import torch._dynamo

    from ..ops.dispatch import prepare_compile

    prepare_compile()
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def compile_trunk(model: Any, **kw: Any) -> Any:
    """Store ``torch.compile(type(model)._trunk, **kw)`` (the unbound method: a deep copy keeps its own weights)
    on ``model`` (``disable=True``: drop it); one graph per input shape, tier and padding mode, at most 64."""
    if kw.pop("disable", False):
        model.__dict__.pop(_KEY, None)
        return model
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    prepare_dynamo(64)
    kw.setdefault("dynamic", False)
    model.__dict__[_KEY] = _announcing(torch.compile(type(model)._trunk, **kw))
    return model


def compiled_trunk(model: Any) -> Callable | None:
    """The compiled trunk stored by :func:`compile_trunk`, or None."""
    return model.__dict__.get(_KEY)


def trunk_for(model: Any, cache: Any = None) -> Callable:
    """The trunk a forward call runs: the compiled one when there is one and no ``cache``, else the eager one
    (called as ``trunk(model, input_ids, tier, positions, valid, cache, backend, logits)``)."""
    compiled = compiled_trunk(model)
    return compiled if compiled is not None and cache is None else type(model)._trunk


def scan_backend(model: Any, backend: str, device: torch.device) -> str:
    """``backend`` resolved eagerly (``ops/dispatch.py``) for the scan of ``model``'s spectral layers on ``device``
    (unchanged when the model has none)."""
    mixer = next((b.mixer for b in getattr(model, "blocks", []) if getattr(b, "kind", None) == "S"), None)
    if mixer is None:
        return backend
    dtype = torch.promote_types(mixer.theta.dtype, torch.float32)
    return resolve_backend(backend, torch.empty(0, device=device, dtype=dtype))


@torch.no_grad()
def capture_graph(run: Callable[[], Any], warmup: int = 2, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` captured in a CUDA graph (memory ``pool``) after ``warmup`` eager calls on a side stream, so
    compiling, autotuning and library handles happen outside the capture: the graph and the outputs it writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


#: the most padded prompt tokens (rows x length bucket) a prefill graph of an eager trunk takes; larger prefills run
#: eagerly (the measurement: docs/performance.md, "Graphed compiled prefill")
GRAPH_TOKENS = 2048


def length_bucket(T: int, min_step: int = 256) -> int:
    """The captured prompt length serving T tokens: T rounded up to a multiple of max(2^(bits(T) - 4),
    ``min_step``) (a power of two): at most 1/8 of padding once T > 8 ``min_step``."""
    if T < 1:
        raise ValueError(f"a prompt needs at least one token, got length {T}")
    if min_step < 1 or min_step & (min_step - 1):
        raise ValueError(f"min_step must be a power of two, got {min_step}")
    step = max(min_step, 1 << max(0, T.bit_length() - 4))
    return -(-T // step) * step


class PrefillGraph:
    """Prefill of ``cache.batch`` prompts of ``length`` tokens (``padded``: up to ``length``, left-padded) at
    ``cache.tier`` into ``cache``. ``graph=False`` runs the static-buffer function eagerly (CPU tests); ``pool``:
    the CUDA graph memory pool of one model's prefill graphs (they never overlap)."""

    def __init__(self, model, cache: ESSHCache, length: int, padded: bool, graph: bool = True, pool=None,
                 row_tiers: bool = False) -> None:
        self.model, self.cache, self.length, self.padded = model, cache, length, padded
        B, dev = cache.batch, cache.positions.device
        # row_tiers: each call names one tier per row (nested in cache.tier), written into static factors
        self.rows = model.row_tiers([cache.tier] * B, cache.tier) if row_tiers else None
        self.ids = torch.zeros(B, length, dtype=torch.long, device=dev)
        self.mask = torch.ones(B, length, dtype=torch.bool, device=dev) if padded else None
        self._positions = torch.arange(length, device=dev).expand(B, length)
        self._backend = scan_backend(model, "auto", dev)
        self._trunk = trunk_for(model)
        self.compiled = compiled_trunk(model) is not None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        if graph:   # compile, autotune and create handles outside the capture
            self._graph, self._logits = capture_graph(self._run, 2, pool)

    def _run(self) -> torch.Tensor:
        """The captured work: trunk into the cache, next positions, last-position logits [B, V]."""
        m, cache = self.model, self.cache
        if self.padded:
            valid = self.mask
            n, positions = valid.long().sum(1), token_positions(valid, *valid.shape, None)
        else:
            valid, positions = None, self._positions
            n = torch.full_like(cache.positions, self.length)
        tier = cache.tier if self.rows is None else self.rows
        h = self._trunk(m, self.ids, tier, positions, valid, cache, self._backend, False)
        cache.positions.copy_(n)
        return m.logits_from_hidden(h[:, -1])

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 tiers: list | None = None) -> torch.Tensor:
        """input_ids [B, T] (B <= batch, T <= length; left padding per ``attention_mask``) -> logits [B, V];
        ``tiers``: one ``Tier`` per row (a graph built with ``row_tiers=True``; None: every row at cache.tier)."""
        B, T = input_ids.shape
        if tiers is not None and self.rows is None:
            raise ValueError("this prefill graph runs every row at its cache's tier; build it with row_tiers=True")
        if self.rows is not None:
            self.rows.assign(tiers or [self.cache.tier] * B, self.model.config.value_width)
        L = self.length
        if B > self.cache.batch or T > L or (not self.padded and (T != L or attention_mask is not None)):
            raise ValueError(f"this prefill graph takes up to {self.cache.batch} prompts of "
                             f"{'at most ' if self.padded else 'exactly '}{L} tokens"
                             f"{'' if self.padded else ' without a mask'}; got {tuple(input_ids.shape)}")
        self.ids[:B, L - T:].copy_(input_ids)
        if self.padded:
            self.ids[:B, :L - T].zero_()
            self.mask[:B, :L - T].fill_(False)
            self.mask[:B, L - T:] = True if attention_mask is None else attention_mask.bool()
            self.mask[B:].copy_(self.mask[:1].expand_as(self.mask[B:]))
        self.ids[B:].copy_(self.ids[:1].expand_as(self.ids[B:]))
        if self._graph is not None:
            self._graph.replay()
            return self._logits[:B]
        return self._run()[:B]
