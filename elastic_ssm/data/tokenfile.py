"""Prepared token files: ``<out>.bin`` (uint16 when V <= 65535, else uint32) and a JSON sidecar ``<out>.bin.json``
(dtype, count, tokenizer, source, split, sha256, sampled ``fingerprint``), written by ``prepare`` one chunk at a
time, read by ``TokenFile`` and ``load_corpus``."""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from ..utils.files import atomic_write_text, atomic_writer, cache_dir
from ..utils.progress import progress
from .corpora import cap_bytes, iter_documents
from .packing import TokenArray, iter_token_chunks, pack_documents, token_dtype, tokens_fingerprint
from .pysrc import VAL_FRACTION, is_pysrc, manifest, stdlib_root
from .tokenizers import load_tokenizer

FORMAT = "elastic_ssm.tokens"
VERSION = 1


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of a token file: ``train.bin`` -> ``train.bin.json``."""
    path = Path(path)
    return path if path.name.endswith(".bin.json") else path.with_name(path.name + ".json")


def prepare(source, out_path: str | Path, tokenizer="bytes", split: str | None = None, *,
            text_field: str = "text", max_tokens: int | None = None, show_progress: bool = False,
            extra_meta: dict | None = None) -> TokenFile:
    """Tokenize every document of ``source`` (``iter_documents``), each followed by SEP, into the token file
    ``out_path``; ``max_tokens`` cuts the stream exactly there; ``extra_meta`` goes into the sidecar (a ``pysrc``
    source's file and byte counts by default). Returns the opened ``TokenFile``."""
    out_path = Path(out_path)
    if out_path.suffix != ".bin":     # load_corpus knows a token file by its name: anything else is read as text
        raise ValueError(f"{out_path}: a token file's name must end in .bin (e.g. {out_path.with_suffix('.bin')}), "
                         "or training and evaluation would read its bytes as text")
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    digest, count, n_docs = hashlib.sha256(), 0, itertools.count()
    with progress(desc=f"prepare {out_path.name}", unit="tok", unit_scale=True, total=max_tokens,
                  enabled=show_progress) as bar:
        with atomic_writer(out_path) as f:   # replaces out_path only when the block completes
            docs = (d for d, _ in zip(iter_documents(source, split, text_field=text_field), n_docs))  # counted
            for chunk in iter_token_chunks(docs, tok):
                if max_tokens is not None:
                    chunk = chunk[: max_tokens - count]
                if len(chunk) and int(chunk.max()) >= tok.vocab_size:
                    raise ValueError(f"token id {int(chunk.max())} >= vocab_size {tok.vocab_size}")
                data = chunk.astype(dtype).tobytes()
                f.write(data)
                digest.update(data)
                count += len(chunk)
                bar.update(len(chunk))
                if max_tokens is not None and count >= max_tokens:
                    break
            if count == 0:
                raise ValueError(f"source {source!r} (split={split}) produced no tokens")
            sidecar = sidecar_path(out_path)
            sidecar.unlink(missing_ok=True)   # never an old sidecar beside the new tokens
        meta = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name, "count": count,
            "tokenizer": tok.spec, "tokenizer_sha256": getattr(tok, "sha256", None),
            "vocab_size": tok.vocab_size, "sep_id": tok.sep_id, "source": str(source), "split": split,
            "text_field": text_field, "num_documents": next(n_docs), "sha256": digest.hexdigest(),
            "fingerprint": tokens_fingerprint(np.memmap(out_path, dtype=dtype, mode="r", shape=(count,))),
        }
        if is_pysrc(source) and extra_meta is None:
            extra_meta = {"pysrc": manifest(str(source)).stats(split)}
        meta.update(extra_meta or {})
        if str(source) == "stdlib" or is_pysrc(source):
            meta.update(python=sys.version.split()[0], stdlib_root=str(stdlib_root()))
        atomic_write_text(sidecar, json.dumps(meta, indent=2) + "\n")
    return TokenFile(out_path)


class TokenFile(TokenArray):
    """A prepared token file, memory-mapped read-only (``tokens``: ``np.memmap`` [N]); a missing file or sidecar and
    a size that differs from the sidecar's count are refused in one line."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.name.endswith(".bin.json"):
            path = path.with_name(path.name[: -len(".json")])
        self.path, self.sidecar = path, sidecar_path(path)
        if not path.is_file():
            raise FileNotFoundError(f"token file not found: {path}; create it with elastic-ssm prepare")
        if not self.sidecar.is_file():
            raise FileNotFoundError(f"missing sidecar {self.sidecar} for token file {path}: without it the "
                                    "dtype and tokenizer are unknown; re-run elastic-ssm prepare")
        try:
            self.meta = json.loads(self.sidecar.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"corrupt sidecar {self.sidecar}: {err}; re-run elastic-ssm prepare") from err
        meta = self.meta if isinstance(self.meta, dict) else {"format": self.meta}
        if meta.get("format") != FORMAT or not isinstance(version := meta.get("version", 0), int) or version > VERSION:
            raise ValueError(f"{self.sidecar} is not an elastic_ssm token sidecar of version <= {VERSION} (format="
                             f"{meta.get('format')!r}, version={meta.get('version')!r}); re-run elastic-ssm prepare")
        self.dtype, self.count = np.dtype(self._field("dtype", str, ("uint16", "uint32"))), self._field("count", int)
        self._field("vocab_size", int)
        if self.count < 1:
            raise ValueError(f"{path} holds no tokens (its sidecar says count={self.count}); prepare it from a "
                             "non-empty source")
        found, extra = divmod(path.stat().st_size, self.dtype.itemsize)
        if found != self.count or extra:
            if found < self.count:
                raise ValueError(f"{path}: file truncated: expected {self.count} tokens, found {found}; "
                                 "re-run elastic-ssm prepare")
            raise ValueError(f"{path}: size mismatch: expected {self.count} tokens, found "
                             f"{path.stat().st_size / self.dtype.itemsize:g}; re-run elastic-ssm prepare")
        super().__init__(np.memmap(path, dtype=self.dtype, mode="r", shape=(self.count,)),
                         int(self.meta["vocab_size"]), self.meta)

    def _field(self, key: str, kind: type, choices: tuple = ()):
        """The sidecar's ``key``; one line naming the sidecar if it is missing, not a ``kind`` or not in ``choices``."""
        value = self.meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (choices and value not in choices):
            want = " or ".join(map(repr, choices)) if choices else "an integer" if kind is int else "a string"
            got = f"{key} is {value!r}, not {want}" if key in self.meta else f"it has no {key} ({want})"
            raise ValueError(f"corrupt sidecar {self.sidecar}: {got}; re-run elastic-ssm prepare")
        return value

    def verify(self, chunk: int = 1 << 24) -> None:
        """Recompute the sha256 of the tokens (reads the whole file) and compare with the sidecar."""
        want, digest = self._field("sha256", str), hashlib.sha256()
        for lo in range(0, self.count, chunk):
            digest.update(np.ascontiguousarray(self.tokens[lo : lo + chunk]).tobytes())
        if digest.hexdigest() != want:
            raise ValueError(f"{self.path}: sha256 mismatch with {self.sidecar}; the file is corrupt or "
                             "was replaced; re-run elastic-ssm prepare")

    def check_fingerprint(self) -> None:
        """Compare the sampled ``tokens_fingerprint`` (about 2 MB read, the check a resume makes) with the one
        ``prepare`` recorded (sidecars written before it have none: not checked; ``verify`` checks them)."""
        want = self.meta.get("fingerprint")
        if want and tokens_fingerprint(self.tokens) != want:
            raise ValueError(f"{self.path}: its tokens differ from those prepare wrote (sampled fingerprint "
                             f"mismatch with {self.sidecar.name}): the file was corrupted or edited after prepare; "
                             "re-run elastic-ssm prepare (--overwrite)")

    def check_tokenizer(self, tokenizer) -> None:
        """Raise if ``tokenizer`` is not the one the file was prepared with (vocab size / digest)."""
        if tokenizer.vocab_size != self.vocab_size:
            raise ValueError(f"{self.path} was prepared with tokenizer {self.meta.get('tokenizer')!r} "
                             f"(vocab {self.vocab_size}) but the model uses vocab {tokenizer.vocab_size}; "
                             "re-run elastic-ssm prepare with the same tokenizer")
        want, have = self.meta.get("tokenizer_sha256"), getattr(tokenizer, "sha256", None)
        if want and have and want != have:
            raise ValueError(f"{self.path} was prepared with a different tokenizer.json "
                             f"({self.meta.get('tokenizer')}); re-run elastic-ssm prepare")

    def __repr__(self) -> str:
        return (f"TokenFile({str(self.path)!r}, n={self.count}, dtype={self.dtype.name}, "
                f"vocab={self.vocab_size})")


def load_corpus(source, tokenizer="bytes", split: str | None = "train", *, max_bytes: int | None = None,
                text_field: str = "text", verify: bool = False) -> TokenArray | TokenFile:
    """Tokens of ``source`` for ``PackedBatches``: a prepared ``*.bin`` (``split`` ignored) or a folder's
    ``<split>.bin`` as a ``TokenFile`` (a folder of other ``*.bin`` files is refused, never read as text), checked
    for size, tokenizer and fingerprint (``verify``: the sha256 of all tokens); ``"pysrc..."`` with a split: that
    split's token file in the cache (prepared on first use); anything else tokenized in memory into a
    ``TokenArray`` (``max_bytes`` caps the text read)."""
    tok = load_tokenizer(tokenizer)
    if is_pysrc(source) and split is not None and not max_bytes:
        return pysrc_tokens(str(source), tok, split)       # prepared once into the cache, then memory-mapped
    path = Path(str(source)).expanduser()
    target = None
    if path.name.endswith((".bin", ".bin.json")):
        target = path
    elif path.is_dir() and split is not None and (path / f"{split}.bin").is_file():
        target = path / f"{split}.bin"
    elif path.is_dir() and any(path.glob("*.bin")) | any(path.glob("*.bin.json")):
        names = sorted(p.name for p in path.glob("*.bin"))
        want = path / f"{split}.bin"
        raise FileNotFoundError(f"{path} is a prepared-data folder ({', '.join(names) or 'sidecars only'}) without "
                                f"{want.name}; prepare that split with `elastic-ssm prepare SOURCE {want} --split "
                                f"{split}` (its other files are not read as text)")
    if target is not None:
        tf = TokenFile(target)
        tf.check_tokenizer(tok)
        tf.verify() if verify else tf.check_fingerprint()
        return tf

    try:
        arr = pack_documents(cap_bytes(iter_documents(source, split, text_field=text_field), max_bytes), tok)
    except ValueError as e:
        if "no non-empty documents" not in str(e):
            raise
        whole = Path(str(source))
        size = whole.stat().st_size if whole.is_file() else 0
        if split is not None and size > 0:     # the file has text, its split has none: it is too small to split
            raise ValueError(f"source {str(source)!r} holds {size:,} bytes, too few to give its {split} split any "
                             f"text (a text file's last {VAL_FRACTION:.0%}, cut at a line break, is validation); use "
                             "a larger file, or another source for that split") from None
        raise ValueError(f"source {str(source)!r} (split {split}) holds no text to tokenize; give a non-empty "
                         "file or folder") from None
    arr.meta.update(source=str(source), split=split, tokenizer=tok.spec)
    return arr


def pysrc_tokens(spec: str, tokenizer, split: str):
    """The tokens of one split as a memory-mapped ``TokenFile`` from the cache (prepared on first use)."""
    m = manifest(spec)
    tag = hashlib.sha256(f"{m.key}\0{tokenizer.spec}\0{getattr(tokenizer, 'sha256', '')}".encode()).hexdigest()
    path = cache_dir() / "tokens" / f"pysrc-{tag[:24]}" / f"{split}.bin"
    try:
        tf = TokenFile(path)
        if tf.meta.get("pysrc", {}).get("manifest") == m.key:
            tf.check_fingerprint()      # a cache file changed in place is prepared again
            return tf
    except (FileNotFoundError, ValueError):
        pass
    return prepare(spec, path, tokenizer, split=split, show_progress=False, extra_meta={"pysrc": m.stats(split)})
