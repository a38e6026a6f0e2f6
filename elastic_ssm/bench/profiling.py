"""Helpers of the GPU scripts: the top device-time kernels of one call (torch.profiler) and a run log."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["top_kernels", "RunLog"]


def top_kernels(fn: Callable[[], object], n: int = 15, log: Callable[[str], None] = print) -> list[dict]:
    """Profile one call of ``fn`` (CUDA activity only) and ``log`` a summary line and the ``n`` kernels with
    the most self device time; returns those rows as ``{"name", "ms", "count"}``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows)
    rows.sort(key=lambda e: -e.self_device_time_total)
    log(f"  profile: {len(rows)} kernel kinds, {sum(e.count for e in rows)} launches, "
        f"{total / 1e3:.2f} ms device time")
    out = []
    for e in rows[:n]:
        log(f"  {e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:90]}")
        out.append({"name": e.key, "ms": e.self_device_time_total / 1e3, "count": e.count})
    return out


class RunLog:
    """Timestamped, flushed log lines of a GPU script, appended to ``path`` (if given; emptied at the start)
    as each is written, so a run cut short by its time limit still leaves its log."""

    def __init__(self, path=None) -> None:
        self.t0 = time.monotonic()
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(self, s: str) -> None:
        s = f"[{time.monotonic() - self.t0:6.1f}s] {s}"
        print(s, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(s + "\n")
