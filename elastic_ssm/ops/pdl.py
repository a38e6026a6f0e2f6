"""Programmatic dependent launch (PDL) of the decode kernels (CUDA, Hopper and newer; PTX ``griddepcontrol``).

Rules every PDL kernel follows: ``gdc_launch_dependents`` at the program's start; before ``gdc_wait`` only reads
of memory no kernel of the step writes (weights, constant tables); ``gdc_wait`` once per program before its first
activation read and any store. Kernels take a ``PDL: tl.constexpr`` flag (False: CPU interpreter, older GPUs,
``ELASTIC_SSM_PDL=0``); launches pass ``**launch_options(pdl)``."""

from __future__ import annotations

import os

import torch

from ..utils.environment import env_flag
from .dispatch import triton_interpreting

__all__ = ["pdl_supported", "resolve_pdl", "launch_options"]


def pdl_supported(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability >= 9.0, outside the Triton interpreter, unless the
    environment sets ``ELASTIC_SSM_PDL=0``."""
    device = torch.device(device)
    off = "ELASTIC_SSM_PDL" in os.environ and not env_flag("ELASTIC_SSM_PDL")    # 0 / false / off; garbage: one line
    if device.type != "cuda" or triton_interpreting() or off:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_pdl(pdl: bool | str, device: torch.device | str) -> bool:
    """``pdl``: True / False, or 'auto' (= :func:`pdl_supported`). True on an unsupported device raises."""
    if pdl == "auto":
        return pdl_supported(device)
    if pdl not in (True, False):
        raise ValueError(f"pdl must be True, False or 'auto', got {pdl!r}")
    if pdl and not pdl_supported(device):
        raise ValueError("pdl=True needs a CUDA device of compute capability >= 9.0 (Hopper) outside the "
                         "Triton interpreter and ELASTIC_SSM_PDL unset or 1; use pdl='auto' or False")
    return bool(pdl)


def launch_options(pdl: bool) -> dict:
    """Keywords of a Triton launch: ``launch_pdl=True`` when ``pdl`` (an ordinary launch otherwise)."""
    return {"launch_pdl": True} if pdl else {}
