"""One check of a device a user names (``--device``, ``TrainConfig.device``, ``from_pretrained(device=)``).

``checked_device`` turns ``cpu``, ``cuda`` or ``cuda:N`` into a ``torch.device`` or raises one ``ValueError``
line naming the setting and the fix: an unparsable name, a kind other than cpu / cuda (``mps`` names what would
not run: MPS has no float64, which the spectral layers compute their phases in, so ``auto`` never picks it), CUDA
on a machine without it, or a GPU index this machine does not have (torch would otherwise fail later, deep inside
``torch.cuda.set_device`` or the first allocation, with a message that does not name the setting).
"""

from __future__ import annotations

import torch

__all__ = ["checked_device", "DEVICE_CHOICES"]

DEVICE_CHOICES = "cpu, cuda or cuda:N"


def checked_device(spec: str | torch.device, what: str = "device") -> torch.device:
    """``spec`` as a ``torch.device`` that exists on this machine; ``what`` names the setting in errors."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what} {str(spec)!r} is not a device; use {DEVICE_CHOICES}") from None
    if dev.type == "mps":
        raise ValueError(f"{what} {str(spec)!r}: Apple's MPS backend has no float64, which the spectral layers need "
                         "(the damped-rotation phases, ESSH Eq. 5, and the Hankel filters are float64); use cpu")
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
