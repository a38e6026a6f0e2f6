"""Disk cache for the fixed spectral buffers (Hankel eigenfilters and their modal fits).

The buffers depend only on integers and a clip level, are computed in float64 on CPU, and are
reused by every model of a given length, so they are stored once as ``.npz`` files:

* directory: ``$ELASTIC_SSM_CACHE`` if set, otherwise ``~/.cache/elastic_ssm`` (read at call time,
  so a test or a job can redirect it with the environment variable);
* writes are atomic: the arrays go to a temporary file in the same directory, which is then moved
  over the final name with ``os.replace`` -- a reader never sees a half-written file;
* every failure is soft: an unreadable, corrupt or mismatching file reads as a miss, and an
  unwritable directory makes :func:`save_arrays` return ``False`` so the caller simply keeps the
  freshly computed arrays. The cache is an accelerator, never a requirement.

File names carry a format tag (``FORMAT``) so that a change of the stored layout never reads an
old file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..utils.files import atomic_writer

__all__ = ["FORMAT", "cache_dir", "cache_path", "load_arrays", "save_arrays"]

#: Layout tag embedded in every file name; bump it when the stored arrays change meaning.
FORMAT = "v1"

_ENV = "ELASTIC_SSM_CACHE"
_log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The cache directory: ``$ELASTIC_SSM_CACHE`` or ``~/.cache/elastic_ssm`` (may not exist yet)."""
    env = os.environ.get(_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elastic_ssm"


def cache_path(stem: str) -> Path:
    """Full path of the cache entry ``stem`` (a name without directory or suffix)."""
    if not stem or "/" in stem or os.sep in stem:
        raise ValueError(f"cache entry name must be a plain file stem, got {stem!r}")
    return cache_dir() / f"{stem}.{FORMAT}.npz"


def load_arrays(stem: str, expected: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """Read the entry ``stem`` if it holds exactly the arrays and shapes in ``expected``.

    Args:
        stem: entry name, e.g. ``"hankel_L2048_K32"``.
        expected: array name -> required shape; ``()`` for a scalar.

    Returns:
        A dict of float64/int arrays, or ``None`` on any miss (absent, unreadable, corrupt, or a
        shape that does not match -- the caller then recomputes).
    """
    path = cache_path(stem)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            out = {name: np.array(data[name]) for name in expected}
    except Exception as err:  # a corrupt or foreign file is a miss, never a crash
        _log.debug("ignoring unreadable cache file %s: %s", path, err)
        return None
    for name, shape in expected.items():
        if out[name].shape != tuple(shape):
            _log.debug("ignoring cache file %s: %s has shape %s, expected %s",
                       path, name, out[name].shape, shape)
            return None
    return out


def save_arrays(stem: str, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` to the entry ``stem`` atomically (``utils.files.atomic_writer``: temporary file, fsync,
    ``os.replace``; mode 0666 less the umask, so several users can share the cache).

    Returns:
        ``True`` when the entry was written, ``False`` when the directory is not usable (no error
        is raised: the caller already holds the arrays and continues without the cache).
    """
    path = cache_path(stem)
    try:
        with atomic_writer(path) as fh:
            np.savez(fh, **arrays)
        return True
    except OSError as err:
        _log.debug("spectral cache not written (%s): %s", path, err)
        return False
