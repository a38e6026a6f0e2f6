"""Kernel configs of fla's autotuned kernels shipped per GPU (``ops/fla_configs/<GPU>/``; issue 39: the first token on
a cold machine), which fla-core itself reads under ``FLA_CACHE_MODE=strict`` and ``FLA_CONFIG_DIR`` (exact autotuning
keys only; docs/performance.md, "Graphed compiled prefill"); ``python -m benchmarks.fla_configs`` builds the files
from Triton's on-disk autotuning results after a run."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

__all__ = ["SHIPPED", "gpu_dir_name", "shipped_dir", "use_shipped_configs"]

SHIPPED = Path(__file__).with_name("fla_configs")


def gpu_dir_name(device_name: str) -> str:
    """A GPU's name as fla names its config folder (``"NVIDIA H200"`` -> ``"NVIDIA_H200"``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def shipped_dir(device_name: str, root: Path = SHIPPED) -> Path | None:
    """The shipped config folder of the GPU ``device_name``, or None when there is none."""
    d = root / gpu_dir_name(device_name)
    return d if d.is_dir() and any(d.glob("*.json")) else None


def use_shipped_configs(root: Path = SHIPPED) -> Path | None:
    """Before fla is imported, on CUDA: ``FLA_CONFIG_DIR`` = this GPU's shipped folder and ``FLA_CACHE_MODE=strict``
    (exact keys only). Nothing when the user set either variable, fla's cache module is already imported (it reads
    the mode once), CUDA is absent or nothing is shipped for this GPU. Returns the folder in use, or None."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ or "fla.ops.utils.cache" in sys.modules:
        return None
    if not torch.cuda.is_available():
        return None
    d = shipped_dir(torch.cuda.get_device_name(0), root)
    if d is not None:
        os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(d), "strict"
    return d
