"""Cost of the sha256 integrity checks (issue 14) at a preset's size, save side and load side (suite kind
``checksum_cost``; CPU and disk, no GPU).

The model's state dict is built on the meta device and filled with zeros (no initialisation cost), then every
step is timed after ``os.sync()`` so that earlier dirty pages do not land in the next measurement:

* ``hash``: ``hashlib.sha256`` of the serialised ``model.safetensors`` bytes alone;
* ``plain`` / ``hashed``: write + fsync of those bytes without a hash, and through
  ``utils.files.atomic_write_bytes`` (temporary file, fsync, rename, hash in a thread beside the write),
  alternating ``repeats`` times;
* ``save_model_dir``: what a checkpoint's ``model/`` costs (serialise, hashed write, ``config.json``);
* ``load verify=False`` / ``load verify=True``: ``from_pretrained`` without and with the check.

A row per step: seconds and, for the hash, GB/s. Needs about 3x the weights' size in free memory and 2x on
disk (``dir``, removed at the end).
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["ChecksumOptions", "run_checksum", "measure"]


@dataclass(kw_only=True)
class ChecksumOptions(ConfigBase):
    """Preset and scratch folder of the checksum cost."""

    preset: str = opt("1.5b", "ESSH preset whose weights are written and read")
    dir: str = opt("", "scratch folder, removed at the end ('' = a folder in the entry's output)")
    repeats: int = opt(2, "repeats of the write and load measurements")

    def validate(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"ChecksumOptions.repeats must be >= 1, got {self.repeats}")


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, started after flushing dirty pages."""
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _plain_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def measure(preset: str, root: Path, repeats: int) -> dict[str, float]:
    """``{"weights GB", "hash", "plain #i", "hashed #i", "save_model_dir", "load verify=... #i"}`` (seconds)."""
    from safetensors.torch import save

    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models.essh import ESSH
    from elastic_ssm.utils.files import atomic_write_bytes

    root.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = ESSH(ESSHConfig.preset(preset))
    state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    res: dict[str, float] = {}
    blob = save(state)
    res["weights GB"] = len(blob) / 1e9
    res["hash"] = _timed(partial(hashlib.sha256, blob))
    target = root / "weights.bin"
    for i in range(repeats):
        res[f"plain #{i}"] = _timed(partial(_plain_write, target, blob))
        target.unlink()
        res[f"hashed #{i}"] = _timed(partial(atomic_write_bytes, target, blob))
        target.unlink()
    blob = b""
    gc.collect()
    model_dir = root / "model"
    res["save_model_dir"] = _timed(partial(model.save_pretrained, model_dir, state_dict=state))
    state = {}
    gc.collect()
    for i in range(repeats):
        for verify in (False, True):
            res[f"load verify={verify} #{i}"] = _timed(partial(ESSH.from_pretrained, model_dir, verify=verify))
            gc.collect()
    return res


def run_checksum(opts: ChecksumOptions, ctx) -> list[dict]:
    """A row per step: ``{"preset", "step", "seconds", "weights_gb", "gb_s"}``."""
    root = Path(opts.dir) if opts.dir else ctx.out_dir / "scratch"
    try:
        res = measure(opts.preset, root, opts.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = res.pop("weights GB")
    return [{"preset": opts.preset, "step": name, "seconds": s, "weights_gb": size,
             "gb_s": size / s if name == "hash" and s > 0 else None} for name, s in res.items()]
