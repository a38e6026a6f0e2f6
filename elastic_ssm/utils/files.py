"""Atomic file writes, one implementation for every file elastic_ssm writes: ``.<name>.<random>.tmp`` in the target's
directory, flushed, ``fsync``ed, mode 0666 less the umask, then ``os.replace``d over the target (a reader sees the
old file or the complete new one; after a crash only a temporary file is left, see :func:`is_temp_name`); and the
one check of an output path before the work that fills it (:func:`check_output_path`)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from ..config import ConfigError

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "cache_dir", "fsync_dir", "is_temp_name",
           "with_path", "process_umask", "free_stamped_path", "check_output_path", "read_json"]


def cache_dir() -> Path:
    """Where elastic_ssm caches what it computes (spectral buffers, ``pysrc`` manifests and tokens):
    ``$ELASTIC_SSM_CACHE`` or ``~/.cache/elastic_ssm`` (may not exist yet)."""
    env = os.environ.get("ELASTIC_SSM_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elastic_ssm"


def free_stamped_path(folder: Path, head: str, tail: str = "") -> Path:
    """``folder/<head><UTC time><tail>`` (``-1``, ``-2`` ... before ``tail`` when taken): the one name of what is
    set aside instead of deleted (a replaced run, a damaged checkpoint, ...). Nothing is created."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = folder / f"{head}{stamp}{tail}", 1
    while dest.exists():
        dest, n = folder / f"{head}{stamp}-{n}{tail}", n + 1
    return dest


def process_umask() -> int:
    """The process umask: from /proc on Linux (no side effect), else by setting and restoring it."""
    with suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_temp_name(name: str) -> bool:
    """True for the name of a temporary file (or staging directory) of an interrupted atomic write."""
    return name.startswith(".") and ".tmp" in name


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """``with atomic_writer(path) as f: f.write(...)``: a binary file that replaces ``path`` when the block
    ends without an exception (flush, fsync, mode 0666 less the umask, ``os.replace``) and is removed
    otherwise. The parent directory is created when missing."""
    path = Path(path)
    if path.is_dir():                            # else os.replace's error names the temporary file
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file; move the folder aside", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            raise with_path(e, path) from e      # a full disk names the file it could not write
        raise


def with_path(e: OSError, path: str | Path) -> OSError:
    """``e`` (an ``OSError`` raised by a write, which carries no file name) as the same error naming ``path``."""
    return type(e)(e.errno, e.strerror or str(e), str(path))


def atomic_write_bytes(path: str | Path, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (:func:`atomic_writer`); returns its sha256 hex digest, hashed on a
    thread while the bytes are written (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        with atomic_writer(path) as f:
            f.write(data)
        return digest.result()


def atomic_write_text(path: str | Path, text: str) -> str:
    """``atomic_write_bytes(path, text.encode("utf-8"))``; returns the sha256 hex digest."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | Path, default: Any = None) -> Any:
    """The JSON document in file ``path``, or ``default`` when it is missing, unreadable or not JSON: the one read of
    a record that is only a hint or an accelerator (a lock's holder, a cache, a tokenizer's or template's file)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return default


def fsync_dir(path: str | Path) -> None:
    """``fsync`` a directory, so that renames into it (a finished checkpoint) survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_path(flag: str, path: str, kind: str) -> None:
    """Refuse an output ``path`` (``kind`` "file" or "folder") that is the other kind or lies below a file, before
    the work that produces it, or a broken symbolic link on its way (missing folders above it are created later)."""
    p = Path(path)
    for q in (p, *p.parents):     # a link to nothing (or to itself) on the way: else "File exists" after the work
        if q.is_symlink() and not q.exists():
            raise ConfigError(f"{flag} {path}: {q} is a symbolic link to {os.readlink(q)}, which does not exist or "
                              "loops back to itself; remove the link or create its target")
    if kind == "file" and p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path")
    if kind == "folder" and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder (it is created if missing)")
    parent = p.resolve().parent if kind == "file" else p.resolve()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, so nothing can be written below it; choose another path")
