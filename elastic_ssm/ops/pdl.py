"""Programmatic dependent launch (PDL) for the decode kernels (CUDA, Hopper and newer).

A batch-1 decode step is a chain of ~150 short kernels, each of which mostly streams weights. Without
PDL a kernel's programs start only after the previous kernel has finished, so every kernel pays its
launch and its first DRAM round trip (a few microseconds) on the critical path. With PDL
(``launch_pdl=True``; PTX ``griddepcontrol``) a kernel may start as soon as every program of the
previous kernel has signalled ``gdc_launch_dependents``; it then reads what does not depend on the
previous kernel (its weights) and calls ``gdc_wait`` — which returns once the previous kernel has
completed and its writes are visible — before it reads activations or writes anything.

Rules every PDL kernel of this package follows (so the chain stays correct transitively):

* before ``gdc_wait`` it only *reads* memory that no kernel of the step writes (weights, constant tables);
* every kernel launched with PDL calls ``gdc_wait`` (unconditionally, once per program) before its first
  activation read and before any store;
* ``gdc_launch_dependents`` is signalled at the program's start: all of the kernel's programs are then
  resident or done, so the early-starting successor only competes for free SM slots.

Kernels take a ``PDL: tl.constexpr`` flag; with ``PDL=False`` (CPU interpreter, older GPUs, or
``ELASTIC_SSM_PDL=0``) the GDC instructions are not emitted and the launch is an ordinary one; launches
pass ``**launch_options(pdl)``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["pdl_supported", "resolve_pdl", "launch_options"]


def pdl_supported(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability >= 9.0, outside the Triton interpreter, unless the
    environment sets ``ELASTIC_SSM_PDL=0``."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if os.environ.get("ELASTIC_SSM_PDL", "1") == "0":
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
