"""Python sources as corpora (docs/data.md). The split of a file list by file: a file is in validation when the
sha256 of its relative path is below the fraction, whatever other files exist; the standard library's file list.

``pysrc``: every ``.py`` file of the stdlib and the site-packages folders (``"pysrc"``) or of the given folders
(``"pysrc:<root>[,<root>...]"``) as one corpus, each file named ``<label>/<relative path>``
(``stdlib/json/decoder.py``, ``root0/...``); ``manifest(spec)`` hashes each file once (cached in ``cache_dir()``)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import site
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..utils.files import atomic_write_text, cache_dir, read_json

__all__ = ["PREFIX", "is_pysrc", "pysrc_roots", "PySrcManifest", "manifest", "iter_pysrc", "describe_split_files",
           "VAL_FRACTION", "SPLITS", "unit_hash", "check_split", "split_by_path", "stdlib_root", "stdlib_files",
           "tree_files", "stdlib_split_files"]

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


PREFIX = "pysrc"
MANIFEST_VERSION = 1


def is_pysrc(source) -> bool:
    s = str(source)
    return s == PREFIX or s.startswith(PREFIX + ":")


def pysrc_roots(spec: str) -> list[tuple[str, Path]]:
    """``(label, folder)`` pairs of a ``pysrc`` spec; a missing or empty root is a one-line error."""
    if not is_pysrc(spec):
        raise ValueError(f"not a pysrc source: {spec!r}")
    if spec == PREFIX:
        paths = list(site.getsitepackages()) + [sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib")]
        sites = sorted({Path(p).resolve() for p in paths if p and Path(p).is_dir()})
        return [("stdlib", stdlib_root())] + [
            ("site-packages" if i == 0 else f"site-packages.{i}", p) for i, p in enumerate(sites)]
    items = [r.strip() for r in spec[len(PREFIX) + 1:].split(",")]
    if not items or any(not r for r in items):
        raise FileNotFoundError(f"data source {spec!r}: give folders after 'pysrc:', comma-separated "
                                "(pysrc:/usr/lib/python3.12,/opt/src), or plain 'pysrc'")
    roots = []
    for i, r in enumerate(items):
        p = Path(r).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"data source {spec!r}: root {r!r} is not a folder; give existing folders "
                                    "after 'pysrc:'")
        roots.append((f"root{i}", p.resolve()))
    return roots


def _candidates(spec: str) -> list[tuple[str, Path]]:
    """Sorted ``(name, path)`` of every ``.py`` file of the spec's roots."""
    out: dict[str, Path] = {}
    for label, root in pysrc_roots(spec):
        if label == "stdlib":
            rels = stdlib_files(include_tests=True)
        else:
            rels = tree_files(root, "*.py", lambda parts: not any(s.startswith(".") or s == "__pycache__"
                                                                  for s in parts))
        if not rels:
            raise FileNotFoundError(f"data source {spec!r}: no .py files under {root}; give folders that hold "
                                    "Python sources")
        for rel in rels:
            out.setdefault(f"{label}/{rel}", root / rel)
    return sorted(out.items())


@dataclass
class PySrcManifest:
    """The deduplicated, split file list of a ``pysrc`` spec (names as in the module docstring)."""

    spec: str
    roots: list[tuple[str, str]]
    files: dict[str, str]                 # name -> absolute path, kept files only
    sizes: dict[str, int]
    splits: dict[str, list[str]]          # "train" / "validation" -> names in sorted order
    duplicates: int
    duplicate_bytes: int
    key: str                              # digest of the kept names and contents (the token cache's key)

    def stats(self, split: str | None = None) -> dict:
        names = self.splits[split] if split else sorted(self.files)
        return {"spec": self.spec, "roots": [f"{lab}={p}" for lab, p in self.roots], "split": split,
                "files": len(names), "bytes": sum(self.sizes[n] for n in names),
                "duplicates_dropped": self.duplicates, "duplicate_bytes": self.duplicate_bytes,
                "split_rule": f"by file: sha256 of the name < {VAL_FRACTION} -> validation "
                              f"(at least {STDLIB_MIN_VAL_FILES} files)", "manifest": self.key}


def manifest(spec: str, cache: bool = True) -> PySrcManifest:
    """List, stat, hash (once, then cached), deduplicate and split the files of ``spec``."""
    cands = _candidates(spec)
    stats = [(name, p.stat()) for name, p in cands]
    listing = hashlib.sha256(json.dumps([MANIFEST_VERSION, spec] + [
        (n, s.st_size, s.st_mtime_ns, str(p)) for (n, s), (_, p) in zip(stats, cands)]).encode()).hexdigest()
    path = cache_dir() / f"pysrc-manifest-{listing[:24]}.json"
    record = read_json(path) if cache else None
    digests = record.get("sha256") if isinstance(record, dict) else None
    if digests is None or len(digests) != len(cands):
        digests = [hashlib.sha256(p.read_bytes()).hexdigest() for _, p in cands]
        if cache:
            with contextlib.suppress(OSError):   # the cache is an accelerator, never a requirement
                atomic_write_text(path, json.dumps({"spec": spec, "sha256": digests}))
    seen: set[str] = set()
    files, sizes, dups, dup_bytes, key = {}, {}, 0, 0, hashlib.sha256()
    for (name, p), (_, st), h in zip(cands, stats, digests):
        if h in seen:
            dups, dup_bytes = dups + 1, dup_bytes + st.st_size
            continue
        seen.add(h)
        files[name], sizes[name] = str(p), st.st_size
        key.update(f"{name}\0{h}\n".encode())
    names = sorted(files)
    train, val = split_by_path(names, VAL_FRACTION, STDLIB_MIN_VAL_FILES)
    roots = [(lab, str(p)) for lab, p in pysrc_roots(spec)]
    return PySrcManifest(spec, roots, files, sizes, {"train": train, "validation": val}, dups, dup_bytes,
                         key.hexdigest())


def iter_pysrc(spec: str, split: str | None = None):
    """The documents (file bytes, empty files skipped) of ``split`` (None: all), in name order."""
    m = manifest(spec)
    for name in (m.splits[split] if split else sorted(m.files)):
        data = Path(m.files[name]).read_bytes()
        if data:
            yield data


def describe_split_files(train_meta: dict, val_meta: dict) -> str:
    """The corpus line of a run's data report: files and bytes of each split, duplicates, roots ('' when the
    token files are not from a ``pysrc`` source)."""
    t, v = train_meta.get("pysrc"), val_meta.get("pysrc")
    if not t or not v:
        return ""
    return (f"{t['spec']} ({', '.join(t['roots'])}): train {t['files']:,} files / {t['bytes']:,} bytes, "
            f"validation {v['files']:,} files / {v['bytes']:,} bytes, split by file; {t['duplicates_dropped']:,} "
            f"duplicate files ({t['duplicate_bytes']:,} bytes) dropped; manifest {t['manifest'][:16]}")
