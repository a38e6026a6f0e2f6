"""One check of a device a user names (``--device``, ``from_pretrained(device=)``): ``checked_device`` and
``auto_device`` (never mps, which has no float64); the CPU threads torch runs with (``apply_default_threads``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..config import ConfigError

__all__ = ["auto_device", "available_cores", "apply_default_threads", "checked_device", "cpu_threads_for",
           "DEVICE_CHOICES", "MPS_NO_FLOAT64"]

DEVICE_CHOICES = "cpu, cuda or cuda:N"
#: why mps is never used: what would not run there
MPS_NO_FLOAT64 = ("Apple's MPS backend has no float64, which the spectral layers need (the damped-rotation phases, "
                  "ESSH Eq. 5, and the Hankel filters are float64)")


def auto_device() -> tuple[str, str | None]:
    """What ``auto`` means on this machine: ``("cuda", None)`` when CUDA is available, else ``("cpu", note)`` where
    ``note`` is one line saying why not mps when this machine has MPS (None when it has not)."""
    if torch.cuda.is_available():
        return "cuda", None
    return "cpu", (f"device auto: cpu, not mps ({MPS_NO_FLOAT64})" if torch.backends.mps.is_available() else None)


def checked_device(spec: str | torch.device, what: str = "device") -> torch.device:
    """``spec`` as a ``torch.device`` on this machine, else a ``ConfigError`` naming the setting ``what``."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{what} {str(spec)!r} is not a device; use {DEVICE_CHOICES}") from None
    if dev.type == "mps":
        raise ConfigError(f"{what} {str(spec)!r}: {MPS_NO_FLOAT64}; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} {str(spec)!r}: only cpu and cuda are supported; use {DEVICE_CHOICES}")
    if dev.type == "cpu" and dev.index is not None:     # safetensors cannot load onto cpu:N (blamed the file)
        raise ConfigError(f"{what} {str(spec)!r}: the CPU is one device without an index; use cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} {str(spec)!r}: CUDA is not available on this machine; use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ConfigError(f"{what} {str(spec)!r}: this machine has {count} CUDA device(s) (cuda:0 .. "
                             f"cuda:{count - 1}); pick one of them")
    return dev


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
    if os.environ.get("OMP_NUM_THREADS"):
        return f"cpu threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cores, why = available_cores()
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return f"cpu threads: {cores} (the cores this process may use, by {why}; OMP_NUM_THREADS sets another number)"


def cpu_threads_for(device: str) -> str | None:
    """``apply_default_threads()`` when ``device`` (a run's ``train.device``) trains on the CPU, else None; for
    ``auto`` on a machine with MPS and no CUDA the line also says why not mps (``auto_device``)."""
    if device == "cpu":
        return apply_default_threads()
    if device == "auto":
        picked, note = auto_device()
        if picked == "cpu":
            return apply_default_threads() + (f"; {note}" if note else "")
    return None
