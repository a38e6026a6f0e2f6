"""``pysrc`` (docs/data.md): every ``.py`` file of the stdlib and the site-packages folders (``"pysrc"``) or of the
given folders (``"pysrc:<root>[,<root>...]"``) as one corpus, each file named ``<label>/<relative path>``
(``stdlib/json/decoder.py``, ``root0/...``); ``manifest(spec)`` hashes each file once (cached in ``cache_dir()``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..utils.files import atomic_write_text, cache_dir, read_json
from .splits import STDLIB_MIN_VAL_FILES, VAL_FRACTION, split_by_path, stdlib_files, stdlib_root, tree_files

__all__ = ["PREFIX", "is_pysrc", "pysrc_roots", "PySrcManifest", "manifest", "iter_pysrc", "describe_split_files"]

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
