"""Tokenizers behind one interface (``encode`` / ``encode_np`` / ``encode_batch_np`` without specials, ``decode``
dropping specials, ``vocab_size``, ``pad_id`` / ``bos_id`` / ``eos_id`` / ``sep_id``, ``spec``, ``save(dir)``):
``ByteTokenizer`` (no dependency) and ``BPETokenizer`` (a ``tokenizer.json``, yours or one ``train_bpe`` made); and the
tokenizer inside a model directory (``tokenizer_record``, ``load_saved_tokenizer``, ``resolve_tokenizer``): what
it saves and checks is docs/data.md, the paragraph on the tokenizer ``train`` saves with the model."""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.files import atomic_write_text
from .corpora import cap_bytes, iter_documents

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")
MAX_BPE_VOCAB = 1 << 24   # far above any real vocabulary: the BPE trainer's memory grows with it, and it aborts
SPECIAL_ROLES = ("bos", "eos", "pad", "sep")
META_FILE = "elastic_tokenizer.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BYTES_FINGERPRINT = hashlib.sha256(b"elastic_ssm.ByteTokenizer:bytes0-255+pad,bos,eos,sep").hexdigest()
_INSTALL_HINT = 'BPE tokenizers need the `tokenizers` package: pip install "elastic-ssm[data]"'

# Names under which common tokenizer.json files carry their specials (first match wins).
_CANDIDATES = {
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
    "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "[SEP]"),
    "sep": ("<sep>", "<|sep|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]"),
}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return tokenizers


def _as_text(doc: str | bytes) -> str:
    """``doc`` for the tokenizers library: bytes decoded (UTF-8, replacement), anything else checked by ``_utf8``."""
    if not isinstance(doc, (bytes, bytearray)):
        _utf8(doc)        # another type or a lone surrogate: one line (the library's own error names neither)
    return doc.decode("utf-8", errors="replace") if isinstance(doc, (bytes, bytearray)) else doc


def _in_vocab(ids: Iterable[int], V: int) -> list[int]:
    """The ids of ``ids`` (any shape) in ``[0, V)``, others dropped; a non-integer id (``1.5``) is a one-line error."""
    try:
        flat = [operator.index(i) for i in (ids.reshape(-1).tolist() if hasattr(ids, "reshape") else ids)]
    except TypeError as e:
        raise TypeError(f"decode takes integer token ids ({e}); round or cast them first") from None
    return [i for i in flat if 0 <= i < V]


def _utf8(doc: Any) -> bytes:
    """``doc`` (str or bytes) as UTF-8; another type, or a str with a lone surrogate (not UTF-8), a one-line error."""
    if not isinstance(doc, (str, bytes, bytearray, memoryview)):     # bytes(5) was five zero bytes
        raise TypeError(f"encode takes a str (or UTF-8 bytes), got {type(doc).__name__}")
    try:
        return doc.encode("utf-8") if isinstance(doc, str) else bytes(doc)
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate U+{ord(doc[e.start]):04X} at character {e.start}, not valid "
                         "UTF-8: pass the original bytes or text.encode('utf-8', 'replace').decode()") from None


class ByteTokenizer:
    """Byte-level tokenizer: token id = byte value (0..255); specials PAD/BOS/EOS/SEP = 256..259."""

    PAD, BOS, EOS, SEP = 256, 257, 258, 259
    pad_id, bos_id, eos_id, sep_id = PAD, BOS, EOS, SEP
    vocab_size = 260
    spec = "bytes"

    def encode_np(self, doc: str | bytes) -> np.ndarray:
        """Bytes of ``doc`` (UTF-8 for ``str``) as an int64 array ``[n]``."""
        return np.frombuffer(_utf8(doc), dtype=np.uint8).astype(np.int64)

    def encode(self, doc: str | bytes) -> list[int]:
        """Token ids of ``doc`` (no special tokens added)."""
        return self.encode_np(doc).tolist()

    def encode_batch_np(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode_np(d) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(_in_vocab(ids, 256)).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> list[str]:
        """``save_tokenizer_files``: ``load_tokenizer(directory)`` reads it back."""
        return save_tokenizer_files(self, directory)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=260)"


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` behind the ``ByteTokenizer`` interface; special ids are found by name
    (``_CANDIDATES``); a file without a separator-like token gets ``<sep>`` added (``vocab_size`` one larger)."""

    def __init__(self, tokenizer, path: str | Path | None = None, special_names: dict[str, str] | None = None):
        self._tok = tokenizer
        self.path = None if path is None else Path(path)
        ids = {}
        for role, names in _CANDIDATES.items():
            named = (special_names or {}).get(role)
            ids[role] = next((i for i in map(tokenizer.token_to_id, (named, *names) if named else names)
                              if i is not None), None)
        if ids["sep"] is None:
            tokenizer.add_special_tokens(["<sep>"])
            ids["sep"] = tokenizer.token_to_id("<sep>")
        self._ids = {k: (ids["sep"] if v is None else v) for k, v in ids.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a ``tokenizer.json``; the specials that a ``tokenizer_config.json`` beside it names (``bos_token``,
        ...: a Hugging Face tokenizer folder) take precedence over the usual spellings."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}; train one with "
                                    "`elastic-ssm tokenizer train` or pass 'bytes'")
        names = {}
        hf_config = path.with_name("tokenizer_config.json")
        if hf_config.is_file():
            try:
                cfg = json.loads(hf_config.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{hf_config} is not valid JSON ({e}); restore it from where the tokenizer was "
                                 "saved, or delete it to use the usual special-token names") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{hf_config} holds a JSON {type(cfg).__name__}, not an object of special tokens; "
                                 "restore it from where the tokenizer was saved")
            for role in _CANDIDATES:
                value = cfg.get(f"{role}_token")
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    names[role] = value
        lib = _import_tokenizers()
        try:
            tok = lib.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for any malformed file
            raise ValueError(f"{path} is not a valid tokenizer.json ({' '.join(str(e).split())}); re-create it "
                             "with `elastic-ssm tokenizer train` or pass 'bytes'") from None
        return cls(tok, path.resolve(), names)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    pad_id, bos_id, eos_id, sep_id = (property(lambda self, r=r: self._ids[r]) for r in ("pad", "bos", "eos", "sep"))

    @property
    def spec(self) -> str:
        return str(self.path) if self.path is not None else "bpe:<in-memory>"

    @property
    def sha256(self) -> str:
        """Digest of the serialized tokenizer (recorded in token-file sidecars)."""
        return hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()

    def encode(self, doc: str | bytes) -> list[int]:
        """Token ids of ``doc`` (bytes are decoded as UTF-8 with replacement; no specials added)."""
        return self._tok.encode(_as_text(doc), add_special_tokens=False).ids

    def encode_np(self, doc: str | bytes) -> np.ndarray:
        return np.asarray(self.encode(doc), dtype=np.int64)

    def encode_batch_np(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        encs = self._tok.encode_batch([_as_text(d) for d in docs], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: special ids and ids outside the vocabulary are dropped (as ``ByteTokenizer`` does)."""
        return self._tok.decode(_in_vocab(ids, self.vocab_size), skip_special_tokens=True)

    save = ByteTokenizer.save

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, path={self.spec!r})"


Tokenizer = ByteTokenizer | BPETokenizer


def fingerprint(tok: Tokenizer) -> str:
    """SHA-256 of the serialized tokenizer (BPE) or a constant (bytes): equal fingerprints encode alike."""
    return BYTES_FINGERPRINT if isinstance(tok, ByteTokenizer) else tok.sha256


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to ``ByteTokenizer``: id = byte value, specials at 256..259. Byte b is the
    printable stand-in character of byte-level BPE files: printable Latin-1 bytes stand for themselves, the others
    take code points 256, 257, ... in order."""
    tk = _import_tokenizers()
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    extra = iter(range(256, 512))
    vocab = {chr(b) if b in keep else chr(next(extra)): b for b in range(256)}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer_files(tok: Tokenizer | None, directory: str | Path) -> list[str]:
    """Write ``tokenizer.json`` (for bytes an equivalent byte-level file, so ``AutoTokenizer`` works; skipped
    without the ``tokenizers`` package), ``tokenizer_config.json`` (special tokens, left padding) and
    ``elastic_tokenizer.json`` (read by ``load_tokenizer``) into ``directory``, each atomically; returns the names.
    Those of the three not written (all for ``tok`` None) are removed: another tokenizer's must not stay beside it."""
    directory = Path(directory)
    written, is_bytes = [], isinstance(tok, ByteTokenizer)
    try:
        inner = None if tok is None else byte_level_tokenizer() if is_bytes else tok._tok
    except ImportError:
        inner = None
    if inner is not None:
        atomic_write_text(directory / TOKENIZER_FILE, inner.to_str(pretty=True))
        name = (lambda i: SPECIAL_TOKENS[i - ByteTokenizer.PAD]) if is_bytes else tok._tok.id_to_token
        hf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "padding_side": "left",
              **{f"{role}_token": name(getattr(tok, f"{role}_id")) for role in ("bos", "eos", "pad", "sep")}}
        atomic_write_text(directory / TOKENIZER_CONFIG_FILE, json.dumps(hf, indent=2) + "\n")
        written += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
    if tok is not None:
        meta = {"type": "bytes"} if is_bytes else {"type": "bpe", "file": TOKENIZER_FILE}
        specials = {r: getattr(tok, f"{r}_id") for r in ("pad", "bos", "eos", "sep")}
        meta.update(vocab_size=tok.vocab_size, specials=specials, sha256=fingerprint(tok))
        atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2) + "\n")
        written.append(META_FILE)
    for name in {TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, META_FILE} - set(written):
        (directory / name).unlink(missing_ok=True)
    return written


def _names_a_source(s: object) -> bool:
    """Whether ``s`` names an ``iter_documents`` source (``stdlib``, ``hf:...``, an existing path) rather than being
    a document's text (a long text or one with a NUL byte is no file name: the OS refuses it, so it is text)."""
    if not isinstance(s, (str, Path)):
        return False
    if s == "stdlib" or str(s).startswith("hf:"):
        return True
    try:
        return Path(s).exists()
    except (OSError, ValueError):
        return False


def train_bpe(files_or_iterator, vocab_size: int, out_path: str | Path, *, min_frequency: int = 2,
              max_bytes: int | None = None, show_progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``files_or_iterator`` (an ``iter_documents`` spec, a list of them, or
    documents) and save it as ``out_path``; specials ``<pad> <bos> <eos> <sep>`` are ids 0..3, then the 256 bytes."""
    tk = _import_tokenizers()
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least "
                         f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    if vocab_size > MAX_BPE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size:,} is too large: give at most {MAX_BPE_VOCAB:,} (real vocabularies "
                         "hold up to a few 100,000 entries; the BPE trainer reserves memory in proportion to it)")
    if isinstance(files_or_iterator, (str, Path)):
        docs = iter_documents(files_or_iterator)
    elif isinstance(files_or_iterator, (list, tuple)) and all(_names_a_source(s) for s in files_or_iterator):
        docs = (d for s in files_or_iterator for d in iter_documents(s))
    else:
        docs = iter(files_or_iterator)

    texts = (text for d in cap_bytes(docs, max_bytes) if (text := _as_text(d)))
    first = next(texts, None)
    if first is None:
        what = repr(str(files_or_iterator)) if isinstance(files_or_iterator, (str, Path)) else "the given documents"
        raise ValueError(f"the tokenizer's training text is empty ({what} holds no text); give a non-empty source")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                     special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    out_path = Path(out_path)
    atomic_write_text(out_path, tok.to_str())
    return BPETokenizer(tok, out_path.resolve())


def load_tokenizer(spec: str | Path | Tokenizer = "bytes") -> Tokenizer:
    """``"bytes"`` -> ``ByteTokenizer``; a ``tokenizer.json`` path -> ``BPETokenizer``; a directory
    written by ``save`` or by a model's ``save_pretrained``, or a Hugging Face tokenizer folder
    (``tokenizer.json`` + ``tokenizer_config.json``) -> the tokenizer saved there."""
    if isinstance(spec, (ByteTokenizer, BPETokenizer)):
        return spec
    if str(spec) in ("bytes", "byte"):
        return ByteTokenizer()
    path = Path(spec)
    if path.name == META_FILE:
        path = path.parent
    if path.is_dir():
        meta = path / META_FILE
        try:
            kind = json.loads(meta.read_text()).get("type") if meta.is_file() else None
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{meta} is not a valid tokenizer description ({e}); save the tokenizer again") from None
        if kind == "bytes":
            return ByteTokenizer()
        if (path / "tokenizer.json").is_file():
            return BPETokenizer.from_file(path / "tokenizer.json")
        raise FileNotFoundError(f"{path} holds neither {META_FILE} nor tokenizer.json; give 'bytes', a "
                                "tokenizer.json file or a folder holding one")
    if path.suffix == ".json":
        return BPETokenizer.from_file(path)  # names a missing file
    raise ValueError(f"unknown tokenizer {str(spec)!r}: use 'bytes', a path to a tokenizer.json, or a "
                     "directory written by tokenizer.save()")


def tokenizer_record(tok: Tokenizer) -> dict[str, Any]:
    """What ``config.json`` records of the model's tokenizer."""
    return {"type": "bytes" if isinstance(tok, ByteTokenizer) else "bpe", "vocab_size": int(tok.vocab_size),
            "fingerprint": fingerprint(tok), **{f"{r}_token_id": getattr(tok, f"{r}_id") for r in SPECIAL_ROLES}}


def load_saved_tokenizer(directory: str | Path, record: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer saved in a model directory (None when there is none); one whose fingerprint or special ids
    differ from ``record`` (``config.json``'s) is a ``ValueError``: its files were replaced."""
    directory = Path(directory)
    has_meta, has_file = (directory / META_FILE).is_file(), (directory / TOKENIZER_FILE).is_file()
    if not has_meta and not has_file:
        return None
    kind = (record or {}).get("type")     # the file the record of config.json needs, when it is missing
    missing = META_FILE if kind == "bytes" and not has_meta else TOKENIZER_FILE if kind == "bpe" and not has_file \
        else None
    if missing is not None:
        raise FileNotFoundError(f"{directory / missing} is missing: this model's {kind} tokenizer is read from it; "
                                "restore it from where the model was saved")
    tok = load_tokenizer(directory)
    if record is not None and record.get("fingerprint") not in (None, fingerprint(tok)):
        raise ValueError(f"the tokenizer files in {directory} do not match the tokenizer recorded in its "
                         "config.json (fingerprint differs): they were replaced after the model was saved")
    changed = [f"{role} {record[f'{role}_token_id']} -> {getattr(tok, f'{role}_id')}" for role in SPECIAL_ROLES
               if record is not None and record.get(f"{role}_token_id") not in (None, getattr(tok, f"{role}_id"))]
    if changed:       # the fingerprint covers tokenizer.json; the special tokens are named in tokenizer_config.json
        raise ValueError(f"the special tokens of the tokenizer in {directory} ({', '.join(changed)}) differ from "
                         f"those recorded in its config.json: {TOKENIZER_CONFIG_FILE} was edited or replaced after "
                         "the model was saved; restore it")
    return tok


def check_same_tokenizer(given: Tokenizer, saved: Tokenizer | dict[str, Any], where: str) -> None:
    """A ``ValueError`` (one line) when ``given`` differs from the model's saved tokenizer (or its record)."""
    rec = tokenizer_record(saved) if not isinstance(saved, dict) else saved
    if given.vocab_size != rec.get("vocab_size") or fingerprint(given) != rec.get("fingerprint"):
        raise ValueError(f"--tokenizer {given.spec} (vocabulary {given.vocab_size}, fingerprint "
                         f"{fingerprint(given)[:12]}) is not the tokenizer saved with {where} "
                         f"(vocabulary {rec.get('vocab_size')}, fingerprint {str(rec.get('fingerprint'))[:12]}); "
                         "leave --tokenizer out to use the saved one")


def resolve_tokenizer(model: Any, spec: Any = None) -> Tokenizer:
    """The tokenizer of ``model``: the saved one (``spec``, when given, must equal it); without one ``spec``, else
    bytes. A tokenizer with more ids than the model's vocabulary is refused."""
    saved = getattr(model, "tokenizer", None)
    record = getattr(model, "tokenizer_record", None)
    where = f"the model {getattr(model, 'name_or_path', None) or '(in memory)'}"
    if spec is None or spec == "":
        if saved is not None:
            return saved
        folder = Path(model.name_or_path) if getattr(model, "name_or_path", None) else None
        if record is not None and folder is not None and folder.is_dir() and not any(
                (folder / f).is_file() for f in (META_FILE, TOKENIZER_FILE)):
            raise ValueError(f"the tokenizer recorded in {folder / 'config.json'} ({record.get('type')}, vocabulary "
                             f"{record.get('vocab_size')}) has no files in {folder} ({META_FILE}, {TOKENIZER_FILE}): "
                             "copy them back from where the model was saved, or pass --tokenizer with the tokenizer "
                             "it was trained with")
        if record is not None:      # files there, yet not loaded: the package that reads them is missing
            raise ValueError(f"the tokenizer saved with {where} could not be loaded (a {record.get('type')} tokenizer "
                             "needs the `tokenizers` package: pip install 'elastic-ssm[data]')")
        tok: Tokenizer = ByteTokenizer()
        if model.config.vocab_size != ByteTokenizer.vocab_size:
            warnings.warn(f"the model has no saved tokenizer and a {model.config.vocab_size}-entry vocabulary; "
                          "assuming the byte tokenizer (pass --tokenizer)", stacklevel=2)
    else:
        tok = load_tokenizer(spec)
        if saved is not None or record is not None:
            check_same_tokenizer(tok, saved if saved is not None else record, where)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {tok.spec} has {tok.vocab_size} ids but the model's vocabulary has "
                         f"{model.config.vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return tok
