"""Document sources (docs/data.md, "Sources" gives each one and its deterministic split): ``iter_documents(source,
split=None)`` streams the documents (``bytes`` or ``str``) of ``"stdlib"``, ``"pysrc[:<roots>]"``, a text,
``.jsonl`` or ``.parquet`` file (``.gz`` too), a folder of them or ``"hf:<name>[:<config>][:<split>]"``."""

from __future__ import annotations

import gzip
import json
import os
import socket
import sys
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import pysrc

TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .py .pyi .c .h .cc .cpp .hpp .cu .js .ts .java .go .rs .rb .sh .tex .html .htm .css "
    ".xml .yaml .yml .toml .ini .cfg .csv .tsv .sql .lua .jl .r .scala .kt .swift .m .hs .el .lisp".split())
# Text files larger than this are streamed as several documents cut at line breaks.
MAX_TEXT_DOC_BYTES = 16 << 20


def cap_bytes(docs: Iterable[str | bytes], max_bytes: int | None) -> Iterator[str | bytes]:
    """``docs`` until ``max_bytes`` (in ``len`` units) are reached; the last one is cut so the total is exactly
    ``max_bytes``. No document is read after the cap (``docs`` is consumed lazily). None: no cap."""
    it, seen = iter(docs), 0
    while max_bytes is None or seen < max_bytes:   # checked before the next document is pulled
        d = next(it, None)
        if d is None:
            return
        d = d if max_bytes is None else d[: max_bytes - seen]
        seen += len(d)
        yield d


_FIELD_HINT = "name the text field with text_field (--text_field, --data.text_field)"


def _text_value(value: object, where: str, field: str) -> str | bytes:
    """A row's ``field`` when it is text; a ``ValueError`` naming ``where`` for a number, list or mapping."""
    if isinstance(value, str | bytes):
        return value
    raise ValueError(f"{where}: the {field!r} field holds {type(value).__name__} {str(value)[:40]!r}, not text; "
                     f"{_FIELD_HINT} that holds the documents' text")


# First bytes of compressed files: gzip is read through, the others are refused (never tokenized as text).
_MAGIC = {b"\x1f\x8b": "gzip", b"(\xb5/\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}


def _open_binary(path: Path):
    """``path`` for reading, through gzip when its bytes are gzip's (whatever its name: ``.GZ`` too)."""
    with open(path, "rb") as f:
        head = f.read(6)
    kind = next((k for m, k in _MAGIC.items() if head.startswith(m) and (k != "bzip2" or head[3:4].isdigit())), None)
    if kind not in (None, "gzip"):
        raise ValueError(f"{path} is {kind}-compressed, which is not read (gzip is); decompress it first")
    return gzip.open(path, "rb") if kind else open(path, "rb")


def _kind(path: Path) -> str | None:
    last = Path(path.name.lower().removesuffix(".gz")).suffix
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(last, "text" if last in TEXT_SUFFIXES else None)


def _iter_text(path: Path, split: str | None) -> Iterator[bytes]:
    """One document per file; files above ``MAX_TEXT_DOC_BYTES`` come in pieces cut at line breaks."""
    with _open_binary(path) as f:
        stop = sys.maxsize
        if split is not None:
            if isinstance(f, gzip.GzipFile):
                raise ValueError(f"cannot split the compressed text file {path}; pass a folder or separate "
                                 "train/validation files")
            stop = path.stat().st_size
            f.seek(int(stop * (1.0 - pysrc.VAL_FRACTION)))
            f.readline()  # move the cut to the next line break
            if split == "train":
                stop = f.tell()
                f.seek(0)
        while chunk := f.read(min(MAX_TEXT_DOC_BYTES, stop - f.tell())):
            if len(chunk) == MAX_TEXT_DOC_BYTES:
                chunk += f.readline(stop - f.tell())    # on to the line break, never past the split's end
            yield chunk


def _keep_row(index: int, split: str | None) -> bool:
    return split is None or (pysrc.unit_hash(f"row:{index}") < pysrc.VAL_FRACTION) == (split == "validation")


def _iter_jsonl(path: Path, field: str, split: str | None) -> Iterator[str]:
    with _open_binary(path) as f:
        row = -1
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row += 1
            if not _keep_row(row, split):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(obj, dict) or field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}:{lineno}: no {field!r} field (found {keys}); {_FIELD_HINT}")
            if obj[field]:
                yield _text_value(obj[field], f"{path}:{lineno}", field)


def _iter_parquet(path: Path, field: str, split: str | None) -> Iterator[str | bytes]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError('reading Parquet needs pyarrow: pip install "elastic-ssm[data]"') from err
    try:
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names}); {_FIELD_HINT}")
        batches = pf.iter_batches(columns=[field], batch_size=1024)
        for row, value in enumerate(v for batch in batches for v in batch.column(0).to_pylist()):
            if value and _keep_row(row, split):
                yield _text_value(value, f"{path}: row {row}", field)
    except pa.ArrowException as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err}); replace the file or leave it out") from err


def _check_hub_reachable(spec: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after the hub client's retries (~40 s), when the Hugging Face hub cannot be
    reached: a TCP connection to ``HF_ENDPOINT`` (default https://huggingface.co). Skipped when the user asked
    for the local cache (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co"
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"{spec}: the Hugging Face hub at {endpoint} cannot be reached from here "
                              f"({err.strerror or err}); prepare the data where there is network "
                              "(`elastic-ssm prepare`) and pass the folder, or set HF_DATASETS_OFFLINE=1 to "
                              "read a dataset already in the local cache") from None


def _iter_hf(spec: str, field: str, split: str | None) -> Iterator[str]:
    name, *rest = spec[3:].split(":")
    if len(rest) == 1 and rest[0] in ("train", "validation", "valid", "test"):
        rest = ["", rest[0]]                    # hf:<name>:<split>
    if len(rest) > 2 or not name:
        raise ValueError(f"bad dataset spec {spec!r}: use hf:<name>[:<config>][:<split>]")
    config, hf_split = (x or None for x in [*rest, "", ""][:2])
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"{spec} needs the Hugging Face `datasets` package (pip install datasets) and "
                          "network access; or download the data once and pass the folder") from err
    _check_hub_reachable(spec)
    ds = datasets.load_dataset(name, config, split=hf_split or split or "train", streaming=True)
    for row in ds:
        if field not in row:
            raise ValueError(f"{spec}: no {field!r} field (found {sorted(row)}); {_FIELD_HINT}")
        if row[field]:
            yield _text_value(row[field], spec, field)


def _iter_file(path: Path, field: str, split: str | None):
    """The non-empty documents of one file (each reader skips empty ones); damaged gzip data is named."""
    reader = {"jsonl": _iter_jsonl, "parquet": _iter_parquet}.get(_kind(path))
    try:
        yield from reader(path, field, split) if reader else _iter_text(path, split)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise ValueError(f"{path}: damaged gzip data ({err}); replace the file or leave it out") from err


def folder_files(folder: str | Path) -> list[str]:
    """Sorted POSIX relative paths of the readable files under ``folder`` (hidden entries skipped)."""
    return pysrc.tree_files(Path(folder), "*", lambda parts: not any(s.startswith(".") for s in parts)
                            and _kind(Path(parts[-1])) is not None)


def iter_documents(source: str | Path, split: str | None = None, *, text_field: str = "text") -> Iterator[bytes | str]:
    """The non-empty documents of ``source`` in ``split``: ``bytes`` from text files and the stdlib, ``str`` from
    JSONL, Parquet and datasets."""
    pysrc.check_split(split)
    if not str(source).strip():       # Path("") is the working directory: never read it by accident
        raise ValueError("the data source is an empty string; use 'stdlib', a file, a folder, or "
                         "hf:<name>[:<config>][:<split>]")
    if pysrc.is_pysrc(source):
        yield from pysrc.iter_pysrc(str(source), split)
        return
    if str(source) == "stdlib":
        root = pysrc.stdlib_root()
        for rel in pysrc.stdlib_split_files(split):
            yield (root / rel).read_bytes()
        return
    if str(source).startswith("hf:"):
        yield from _iter_hf(str(source), text_field, split)
        return
    path = Path(source).expanduser()
    if path.is_dir():
        files = folder_files(path)
        if not files:
            raise FileNotFoundError(f"no readable files (text, .jsonl, .parquet) under {path}")
        if split is not None:
            train, val = pysrc.split_by_path(files)
            files = train if split == "train" else val
        for rel in files:
            yield from _iter_file(path / rel, text_field, None)
        return
    if path.is_file():
        if _kind(path) is None and path.suffix.lower() in (".bin", ".json"):
            raise ValueError(f"{path} looks like a prepared token file; open it with TokenFile/load_corpus")
        yield from _iter_file(path, text_field, split)
        return
    if path.exists():                             # a FIFO, socket or device: never read to its (maybe absent) end
        raise ValueError(f"data source {str(source)!r} is not a regular file or folder (a pipe, socket or device); "
                         "save the text into a file and give that")
    raise FileNotFoundError(f"data source not found: {str(source)!r}; use 'stdlib', 'pysrc', a file, a "
                            "folder, or hf:<name>[:<config>][:<split>]")
