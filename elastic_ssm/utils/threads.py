"""The CPU threads torch runs with: the cores this process may use (affinity mask, cgroup quota) unless
``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["available_cores", "apply_default_threads", "cpu_threads_for"]

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(cpu_max: Path = CGROUP_CPU_MAX) -> tuple[int, str]:
    """The cores this process may use and where that number comes from: the affinity mask (Linux), narrowed by a
    cgroup v2 quota (``cpu.max``: quota and period in microseconds) when one is set."""
    try:
        cores, why = len(os.sched_getaffinity(0)), "affinity"
    except AttributeError:                       # macOS, Windows: no affinity call
        cores, why = os.cpu_count() or 1, "cpu_count"
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            limit = max(1, math.ceil(int(quota) / int(period)))
            if limit < cores:
                cores, why = limit, "cgroup quota"
    except (OSError, ValueError):
        pass
    return max(1, cores), why


def apply_default_threads() -> str:
    """Set torch's intra-op threads to ``available_cores()`` unless ``OMP_NUM_THREADS`` is set; returns the line
    that says what runs (for the run's first status line)."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return f"cpu threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cores, why = available_cores()
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return f"cpu threads: {cores} (the cores this process may use, by {why}; OMP_NUM_THREADS sets another number)"


def cpu_threads_for(device: str) -> str | None:
    """``apply_default_threads()`` when ``device`` (a run's ``train.device``) trains on the CPU, else None; for
    ``auto`` on a machine with MPS and no CUDA the line also says why not mps (``devices.auto_device``)."""
    from .devices import auto_device

    if device == "cpu":
        return apply_default_threads()
    if device == "auto":
        picked, note = auto_device()
        if picked == "cpu":
            return apply_default_threads() + (f"; {note}" if note else "")
    return None
