"""Triton side of programmatic dependent launch (rules and host side: ``ops/pdl.py``); imports triton."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_enter", "gdc_launch_dependents", "gdc_wait"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Prologue of a PDL kernel that reads nothing before the wait: signal the successor, then wait for
    the predecessor's writes. With ``PDL=False`` it emits nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
