"""Compiling the ESSH trunk (``ESSH._trunk``: embedding, blocks, final norm, logits) and resolving its scan backend
eagerly. Graphs are cached under ``TORCHINDUCTOR_CACHE_DIR`` (default ``~/.cache/elastic_ssm/inductor``). Also the
one CUDA-graph capture of the fused decoder's steps and of the prefill graphs (``capture_graph``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..ops import resolve_backend

__all__ = ["compile_model", "compile_trunk", "compiled_trunk", "scan_backend", "trunk_for", "compile_cache_dir",
           "capture_graph"]

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
