"""A whole safetensors file onto a CUDA device in large staged reads (issue 39: the load of the first token).

``safe_open(device="cuda")`` copies tensor by tensor from the memory-mapped file: every 4 KB page is faulted in on
first touch and every copy leaves from pageable memory. ``read_to_device`` reads the data section with
``os.preadv`` on ``READERS`` threads into pinned buffers of ``chunk`` bytes and copies each to one device buffer
while the next ones are read (an event per buffer keeps it from being refilled before its copy is done); the
tensors are views of that buffer. Only whole files are read this way (a tier's prefixes go through
``load_sliced_safetensors``' per-tensor path): the views then cover every byte read.

The header is checked before anything is read: entries' offsets must tile the data section exactly, with known
dtypes, sizes that match their shapes and aligned offsets. A file that fails a check returns None, and the caller
reads it with safetensors, whose errors name the corruption (``models/checksums.py`` checks the bytes).
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["read_to_device", "parse_header", "CHUNK_BYTES", "READERS"]

CHUNK_BYTES = 16 << 20
READERS = 4             # threads reading the file; 2 x READERS x CHUNK_BYTES = 128 MiB of staging
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20     # safetensors' own limit on the header's length


def parse_header(path: str | Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]] | None:
    """``(data_start, {name: (dtype, shape, begin, end)})`` with offsets relative to the data section, or None when
    the header is not one this reader trusts (see the module docstring)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    start, entries = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        item = dtype.itemsize
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != math.prod(shape) * item \
                or begin % item or min(shape, default=1) < 0:
            return None
        entries[name] = (dtype, shape, begin, end)
    spans = sorted((b, e) for _, _, b, e in entries.values())
    if any(b != prev_end for (b, _), prev_end in zip(spans, [0] + [e for _, e in spans])) or \
            (spans[-1][1] if spans else 0) != size - start:
        return None
    return start, entries


def _fill(fd: int, view: memoryview, offset: int) -> bool:
    """Read ``len(view)`` bytes of the open file ``fd`` from ``offset`` into ``view``; False if the file ends first.
    ``os.preadv`` writes into the buffer and releases the GIL, so several readers copy out of the page cache at
    once (one thread's copy, ~5 GB/s, was the load's slowest stage)."""
    got, n = 0, len(view)
    while got < n:
        if hasattr(os, "preadv"):
            r = os.preadv(fd, [view[got:]], offset + got)
        else:                                             # no preadv (e.g. Windows): one extra copy
            piece = os.pread(fd, n - got, offset + got)
            view[got:got + len(piece)] = piece
            r = len(piece)
        if not r:
            return False
        got += r
    return True


def read_to_device(path: str | Path, device: torch.device | str, chunk: int = CHUNK_BYTES,
                   readers: int = READERS) -> dict[str, torch.Tensor] | None:
    """Every tensor of the safetensors file ``path`` on ``device`` (views of one buffer), or None when the header
    fails its checks or the file ends early. ``readers`` threads read ``chunk``-byte pieces into ``2 x readers``
    staging buffers (pinned on CUDA) while the pieces already read are copied to the device; a buffer is refilled
    only after its copy is done (an event per buffer). The CPU takes the same path, which its tests check against
    safetensors."""
    parsed = parse_header(path)
    if parsed is None:
        return None
    start, entries = parsed
    device = torch.device(device)
    cuda = device.type == "cuda"
    total = max((e for *_, e in entries.values()), default=0)
    data = torch.empty(total, dtype=torch.uint8, device=device)
    chunk = max(1, min(chunk, total or 1))
    offsets = list(range(0, total, chunk))
    readers = max(1, min(readers, len(offsets) or 1))
    staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(min(2 * readers, len(offsets)))]
    copied: list[torch.cuda.Event | None] = [None] * len(staging)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        with ThreadPoolExecutor(readers) as pool:
            def read(i: int) -> Future:
                k = i % len(staging)
                if copied[k] is not None:
                    copied[k].synchronize()               # this buffer's previous copy has left it
                n = min(chunk, total - offsets[i])
                return pool.submit(_fill, fd, memoryview(staging[k].numpy())[:n], start + offsets[i])

            pending = {i: read(i) for i in range(len(staging))}
            for i, offset in enumerate(offsets):
                if not pending.pop(i).result():
                    return None                           # the file shrank under us: safetensors reports it
                k, n = i % len(staging), min(chunk, total - offset)
                data[offset:offset + n].copy_(staging[k][:n], non_blocking=cuda)
                if cuda:
                    copied[k] = torch.cuda.Event()
                    copied[k].record()
                if i + len(staging) < len(offsets):
                    pending[i + len(staging)] = read(i + len(staging))
    finally:
        os.close(fd)
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return {name: data[b:e].view(dtype).view(shape) for name, (dtype, shape, b, e) in entries.items()}
