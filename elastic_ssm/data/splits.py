"""Train / validation splits by file (a file is in validation when the sha256 of its relative path is below the
fraction, whatever other files exist), and the standard library's file list they split."""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

VAL_FRACTION = 0.02
STDLIB_MIN_VAL_FILES = 8
SPLITS = ("train", "validation")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) for ``key`` (sha256; identical on every machine and Python version)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


def check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS} or None for everything")


def split_by_path(rel_paths: Sequence[str], val_fraction: float = VAL_FRACTION,
                  min_val: int = 1) -> tuple[list[str], list[str]]:
    """``(train, validation)`` in the order of ``rel_paths``: a path is in validation when the hash of its POSIX
    relative path is below ``val_fraction``, topped up to ``min_val`` files by the lowest hashes."""
    if len(rel_paths) < 2:
        raise ValueError(f"cannot split {len(rel_paths)} file(s) into train and validation; pass a "
                         "separate validation source or more files")
    scores = {p: unit_hash(p) for p in rel_paths}
    val = {p for p, u in scores.items() if u < val_fraction}
    if len(val) < min_val:
        val = set(sorted(rel_paths, key=lambda p: (scores[p], p))[: min(min_val, len(rel_paths) - 1)])
    return [p for p in rel_paths if p not in val], [p for p in rel_paths if p in val]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = True) -> list[str]:
    """Sorted POSIX relative paths of the standard library's own ``.py`` files (not site-packages, ``__pycache__``
    or the generated ``_sysconfigdata*`` / ``config-*`` files; ``include_tests``: its test folders, about 60% of the
    bytes). The list differs between Python builds, so the corpus is the same across runs of one machine only."""
    return list(_stdlib_files(include_tests))


def tree_files(root: Path, pattern: str, keep: Callable[[tuple[str, ...]], bool]) -> list[str]:
    """Sorted POSIX relative paths of the files under ``root`` matching ``pattern`` whose relative path parts
    pass ``keep`` (the one file scan of folders, the stdlib and ``pysrc`` roots)."""
    return sorted("/".join(parts) for p in root.rglob(pattern) if keep(parts := p.relative_to(root).parts)
                  and p.is_file())


@functools.lru_cache(maxsize=2)
def _stdlib_files(include_tests: bool) -> tuple[str, ...]:
    def keep(parts: tuple[str, ...]) -> bool:
        dirs = parts[:-1]
        return not (any(d in _SKIP_DIRS or d.startswith("config-") for d in dirs) or parts[-1].startswith(
            "_sysconfigdata") or not include_tests and any(d in ("test", "tests", "idle_test") for d in dirs))

    out = tree_files(stdlib_root(), "*.py", keep)
    if not out:
        raise FileNotFoundError(f"no .py files under the stdlib path {stdlib_root()}; this Python installation "
                                "ships no standard-library sources, so use another source")
    return tuple(out)


def stdlib_split_files(split: str | None, include_tests: bool = True) -> list[str]:
    """The stdlib files of ``split`` (``None``: all), split by file with ``split_by_path``."""
    check_split(split)
    files = stdlib_files(include_tests)
    if split is None:
        return files
    train, val = split_by_path(files, VAL_FRACTION, STDLIB_MIN_VAL_FILES)
    return train if split == "train" else val
