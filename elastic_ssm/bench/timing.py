"""Timing helpers of every benchmark: warm-up then timed calls (CUDA events on the GPU, ``perf_counter`` on
the CPU), medians, wall-clock calls, CUDA-graph replays, OOM as a result."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ..models.compile import capture_graph

__all__ = ["sync", "time_fn", "summarize", "wall_ms", "oom_as_result", "GraphedStep"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> list[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times; per-call times in ms (CUDA events on CUDA,
    one event pair per call, read after one final synchronisation)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        new = lambda: torch.cuda.Event(enable_timing=True)
        ev = [(new(), new()) for _ in range(iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in ev]
    return [wall_ms(fn, device) for _ in range(iters)]


def summarize(times_ms: list[float]) -> dict[str, float]:
    """Median, min and spread (p90 - p10) of a list of times in ms."""
    q = statistics.quantiles(times_ms, n=10) if len(times_ms) >= 2 else [times_ms[0]] * 9
    return {"ms": statistics.median(times_ms), "ms_min": min(times_ms), "ms_spread": q[-1] - q[0], "n": len(times_ms)}


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock ms of one call of ``fn``, the device synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3


@contextlib.contextmanager
def oom_as_result(row: dict, device: torch.device, peak: bool = False) -> Iterator[None]:
    """One benchmark entry: on CUDA the allocator cache is emptied before and after the body (and with ``peak`` the
    peak counter reset, then ``row["peak_gb"]`` set in decimal GB); out-of-memory becomes ``row["error"] = "OOM"``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        if peak:
            torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
        if cuda and peak:
            row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    finally:
        if cuda:
            torch.cuda.empty_cache()


class GraphedStep:
    """CUDA graph of ``step(tokens [B]) -> logits`` for any step function with static buffers
    (``models.compile.capture_graph``)."""

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], batch: int, device: torch.device,
                 warmup: int = 2) -> None:
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.graph, self.out = capture_graph(lambda: step(self.tokens), warmup)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.graph.replay()
        return self.out
