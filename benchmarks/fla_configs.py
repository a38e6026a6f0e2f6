"""Write fla kernel configs from Triton's autotuning results (``<TRITON_CACHE_DIR>/<hash>/<kernel>.autotune.json``,
which ``TRITON_CACHE_AUTOTUNING=1`` writes; the package reads them: ``elastic_ssm/ops/dispatch.py``): run on the
GPU after a run that tuned the shapes to ship (``bench generate/first-token``, a served pool, training), then commit
``elastic_ssm/ops/fla_configs/<GPU>/``. Entries already there are kept; a new result for the same key replaces its
entry. ``python -m benchmarks.fla_configs [--triton_cache DIR] [--out DIR] [--gpu NAME]``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_ssm.config import opt
from elastic_ssm.ops.dispatch import SHIPPED, gpu_dir_name
from elastic_ssm.utils.progress import triton_cache_dir

__all__ = ["FlaConfigsOptions", "write_configs", "configs_from_autotuning", "entry_hash"]

_CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")


@dataclass(kw_only=True)
class FlaConfigsOptions:
    """Where Triton's results are read and the fla config files written."""

    triton_cache: str = opt("", "Triton cache folder to read ('' = TRITON_CACHE_DIR, else ~/.triton/cache)")
    out: str = opt(str(SHIPPED), "folder of the per-GPU config folders")
    gpu: str = opt("", "GPU name of the folder ('' = torch.cuda.get_device_name(0))")


def entry_hash(key: list[Any]) -> str:
    """The entry name fla looks a key up by: md5 of the key as compact, sorted JSON (fla's ``AutotuneKey.key_hash``;
    ``tests/ops/test_tuned_configs_gpu.py`` checks the shipped entries' names against fla's own)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def configs_from_autotuning(triton_cache: Path, triton_version: str = "") -> dict[str, dict[str, Any]]:
    """Every ``*.autotune.json`` under ``triton_cache`` as fla config files: kernel name -> ``{"kernel_name",
    "triton_version", "autotune_entries": {entry_hash(key): {"autotune_key": key, "config": best config}}}``, the
    best config the one Triton picked (the least timing: its lists compare by their first entry, the median).
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
        config, _ = min(timings, key=lambda ct: ct[1])
        entries[entry_hash(key)] = {"autotune_key": key, "config": {k: config.get(k) for k in _CONFIG_FIELDS}}
    return out


def write_configs(triton_cache: Path, out: Path, triton_version: str = "") -> dict[str, int]:
    """Merge the configs of ``triton_cache`` into ``out/<kernel>.json``; returns kernel -> entries written."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for kernel, new in configs_from_autotuning(triton_cache, triton_version).items():
        path = out / f"{kernel}.json"
        old = json.loads(path.read_text()) if path.is_file() else {"autotune_entries": {}}
        new["autotune_entries"] = {**old.get("autotune_entries", {}), **new["autotune_entries"]}
        path.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        counts[kernel] = len(new["autotune_entries"])
    return counts


def main(argv: list[str] | None = None) -> None:
    import torch
    import triton

    from elastic_ssm.cli_util import derive

    a = derive(FlaConfigsOptions, argv, "python -m benchmarks.fla_configs", __doc__.splitlines()[0])
    gpu = a.gpu or torch.cuda.get_device_name(0)
    out = Path(a.out) / gpu_dir_name(gpu)
    counts = write_configs(Path(a.triton_cache) if a.triton_cache else triton_cache_dir(), out, triton.__version__)
    for kernel, n in counts.items():
        print(f"{out / kernel}.json: {n} entries")
    if not counts:
        print(f"no autotuning results under {a.triton_cache or triton_cache_dir()}: run the shapes to ship first")


if __name__ == "__main__":
    main()
