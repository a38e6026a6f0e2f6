"""Cost of the sha256 integrity checks (issue #14) at a preset's size: save side and load side.

Usage::

    python scripts/checksum_cost.py --preset 1.5b --dir /tmp/checksum_cost [--repeats 2]

The model's state dict is built on the meta device and filled with zeros (no initialisation cost), then
every step is timed after ``os.sync()`` so that earlier dirty pages do not land in the next measurement:

* ``hash``: ``hashlib.sha256`` of the serialised ``model.safetensors`` bytes alone;
* ``plain`` / ``hashed``: write + fsync of those bytes without a hash, and through
  ``models.base.atomic_write_bytes`` (temporary file, fsync, rename, hash in a thread beside the write),
  alternating ``--repeats`` times;
* ``save_model_dir``: what a checkpoint's ``model/`` costs (serialise, hashed write, ``config.json``);
* ``load verify=False`` / ``load verify=True``: ``from_pretrained`` without and with the check.

Numbers go to stdout as one line per step; record them in docs/benchmarks.md with the machine, the
versions and the commit. Needs about 3x the weights' size in free memory and 2x on disk.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

import elastic_ssm as es
from elastic_ssm.models.base import atomic_write_bytes
from elastic_ssm.train.checkpoint import save_model_dir


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


def _zero_model(preset: str):
    """The preset's ESSH on the meta device and a zero-filled CPU state dict of the same shapes."""
    with torch.device("meta"):
        model = es.ESSH(es.ESSHConfig.preset(preset))
    state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    return model, state


def measure(preset: str, root: Path, repeats: int) -> dict[str, float]:
    from safetensors.torch import save

    root.mkdir(parents=True, exist_ok=True)
    model, state = _zero_model(preset)
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
    res["save_model_dir"] = _timed(partial(save_model_dir, model, state, model_dir))
    state = {}
    gc.collect()
    for i in range(repeats):
        for verify in (False, True):
            res[f"load verify={verify} #{i}"] = _timed(partial(es.ESSH.from_pretrained, model_dir, verify=verify))
            gc.collect()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.5b", help="ESSH preset whose weights are measured (default 1.5b)")
    p.add_argument("--dir", default="/tmp/checksum_cost", help="scratch folder (removed at the end)")
    p.add_argument("--repeats", type=int, default=2, help="repeats of the write and load measurements")
    a = p.parse_args()
    root = Path(a.dir)
    try:
        res = measure(a.preset, root, a.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = res.pop("weights GB")
    print(f"preset {a.preset}: model.safetensors {size:.2f} GB, torch {torch.__version__}")
    for name, seconds in res.items():
        rate = f"  ({size / seconds:.2f} GB/s)" if name == "hash" else ""
        print(f"  {name:<24} {seconds:7.1f} s{rate}")


if __name__ == "__main__":
    main()
