"""One check of a device a user names (``--device``, ``from_pretrained(device=)``): ``checked_device`` (cpu, cuda,
cuda:N present here; mps refused, it has no float64) and ``auto_device`` (cuda when available, else cpu).
"""

from __future__ import annotations

import torch

__all__ = ["auto_device", "checked_device", "DEVICE_CHOICES", "MPS_NO_FLOAT64"]

DEVICE_CHOICES = "cpu, cuda or cuda:N"
#: why mps is never used: what would not run there
MPS_NO_FLOAT64 = ("Apple's MPS backend has no float64, which the spectral layers need (the damped-rotation phases, "
                  "ESSH Eq. 5, and the Hankel filters are float64)")


def auto_device() -> tuple[str, str | None]:
    """What ``auto`` means on this machine: ``("cuda", None)`` when CUDA is available, else ``("cpu", note)`` where
    ``note`` is one line saying why not mps when this machine has MPS (None when it has not)."""
    if torch.cuda.is_available():
        return "cuda", None
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "cpu", f"device auto: cpu, not mps ({MPS_NO_FLOAT64})"
    return "cpu", None


def checked_device(spec: str | torch.device, what: str = "device") -> torch.device:
    """``spec`` as a ``torch.device`` that exists on this machine; ``what`` names the setting in errors."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what} {str(spec)!r} is not a device; use {DEVICE_CHOICES}") from None
    if dev.type == "mps":
        raise ValueError(f"{what} {str(spec)!r}: {MPS_NO_FLOAT64}; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} {str(spec)!r}: only cpu and cuda are supported; use {DEVICE_CHOICES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what} {str(spec)!r}: CUDA is not available on this machine; use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(f"{what} {str(spec)!r}: this machine has {count} CUDA device(s) (cuda:0 .. "
                             f"cuda:{count - 1}); pick one of them")
    return dev
