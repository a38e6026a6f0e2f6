"""Kernel configs of fla's autotuned kernels shipped per GPU (``ops/fla_configs/<GPU>/``; issue 39: the first token on
a cold machine), which fla-core itself reads under ``FLA_CACHE_MODE=strict`` and ``FLA_CONFIG_DIR`` (exact autotuning
keys only; docs/performance.md, "Graphed compiled prefill"), and the files built from Triton's on-disk autotuning
results (``<TRITON_CACHE_DIR>/<hash>/<kernel>.autotune.json``): ``python -m benchmarks.fla_configs`` after a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHIPPED", "gpu_dir_name", "shipped_dir", "use_shipped_configs", "configs_from_autotuning", "entry_hash"]

SHIPPED = Path(__file__).with_name("fla_configs")
_CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")


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


def entry_hash(key: list[Any]) -> str:
    """The entry name fla looks a key up by: md5 of the key as compact, sorted JSON (fla's ``AutotuneKey.key_hash``;
    ``tests/ops/test_tuned_configs_gpu.py`` checks it against fla's own)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _best(timings: list) -> dict[str, Any]:
    """The config Triton picked: the least timing (its lists compare by their first entry, the median)."""
    config, _ = min(timings, key=lambda ct: ct[1])
    return {k: config.get(k) for k in _CONFIG_FIELDS}


def configs_from_autotuning(triton_cache: Path, triton_version: str = "") -> dict[str, dict[str, Any]]:
    """Every ``*.autotune.json`` under ``triton_cache`` as fla config files: kernel name -> ``{"kernel_name",
    "triton_version", "autotune_entries": {entry_hash(key): {"autotune_key": key, "config": best config}}}``.
    Results with a pre-hook (Triton does not write them) or without timings are skipped."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(triton_cache.glob("*/*.autotune.json")):
        try:
            data = json.loads(path.read_text())
            key, timings = list(data["key"]), data["configs_timings"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not timings:
            continue
        kernel = path.name[: -len(".autotune.json")]
        entries = out.setdefault(kernel, {"kernel_name": kernel, "triton_version": triton_version,
                                          "autotune_entries": {}})["autotune_entries"]
        entries[entry_hash(key)] = {"autotune_key": key, "config": _best(timings)}
    return out
