"""Weight checksums that verify in parallel: sha256 of 64 MiB pieces of ``model.safetensors`` (``config.json``'s
``weights_sha256_pieces``); a mismatch names the byte range.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PIECE_BYTES = 1 << 26

__all__ = ["PIECE_BYTES", "piece_digests", "file_piece_digests", "pieces_record", "mismatched_piece", "PendingCheck"]


def _workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def piece_digests(data: bytes | memoryview, piece: int = PIECE_BYTES) -> list[str]:
    """sha256 hex digests of ``data[i * piece:(i + 1) * piece]``, hashed on several threads."""
    view = memoryview(data)
    starts = range(0, len(view), piece)
    with ThreadPoolExecutor(_workers()) as pool:
        return list(pool.map(lambda s: hashlib.sha256(view[s:s + piece]).hexdigest(), starts))


def file_piece_digests(path: str | Path, piece: int = PIECE_BYTES) -> list[str]:
    """The same digests of a file's bytes, each piece read (``os.pread``) and hashed on its own thread."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(_workers()) as pool:
            return list(pool.map(lambda s: hashlib.sha256(os.pread(fd, piece, s)).hexdigest(), range(0, size, piece)))
    finally:
        os.close(fd)


def pieces_record(data: bytes | memoryview) -> dict:
    """What ``config.json`` stores under ``weights_sha256_pieces``."""
    return {"piece_bytes": PIECE_BYTES, "digests": piece_digests(data)}


def mismatched_piece(path: str | Path, record: dict) -> tuple[int, int] | None:
    """The byte range [start, end) of the first piece whose digest differs from ``record``; None if all match."""
    piece = int(record["piece_bytes"])
    got = file_piece_digests(path, piece)
    want = list(record["digests"])
    if len(got) != len(want):
        return (0, os.path.getsize(path))
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return (i * piece, min((i + 1) * piece, os.path.getsize(path)))
    return None


class PendingCheck:
    """A weights checksum running on a thread (``from_pretrained(defer_verify=True)``): a deep copy of the model
    shares it, and pickling waits for it and stores nothing of it."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def result(self) -> None:
        self.future.result()

    def __deepcopy__(self, memo: dict) -> PendingCheck:
        return self

    def __reduce__(self):
        self.future.result()
        return (type(None), ())
