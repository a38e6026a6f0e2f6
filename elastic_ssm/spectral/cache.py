"""Disk cache of the fixed spectral buffers: ``.npz`` files in ``$ELASTIC_SSM_CACHE`` (else ``~/.cache/elastic_ssm``),
written atomically; every failure is soft (a bad file is a miss): the cache is an accelerator, never a requirement."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..utils.files import atomic_writer, cache_dir

__all__ = ["FORMAT", "cache_dir", "cache_path", "load_arrays", "save_arrays"]

#: Layout tag embedded in every file name; bump it when the stored arrays change meaning.
FORMAT = "v1"

_log = logging.getLogger(__name__)


def cache_path(stem: str) -> Path:
    """Full path of the cache entry ``stem`` (a name without directory or suffix)."""
    return cache_dir() / f"{stem}.{FORMAT}.npz"


def load_arrays(stem: str, expected: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The arrays of entry ``stem`` (e.g. ``"hankel_L2048_K32"``) if it holds exactly ``expected`` (name ->
    shape, ``()`` for a scalar); ``None`` on any miss (absent, unreadable, corrupt, or another shape)."""
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
            _log.debug("ignoring cache file %s: %s has shape %s, expected %s", path, name, out[name].shape, shape)
            return None
    return out


def save_arrays(stem: str, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` to the entry ``stem`` atomically (mode 0666 less the umask: users can share the cache);
    ``False`` (no error) when the directory is not usable."""
    path = cache_path(stem)
    try:
        with atomic_writer(path) as fh:
            np.savez(fh, **arrays)
        return True
    except OSError as err:
        _log.debug("spectral cache not written (%s): %s", path, err)
        return False
