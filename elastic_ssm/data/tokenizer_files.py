"""The tokenizer that travels inside a model directory, its fingerprint, and the ``--tokenizer`` check.

A model directory (``save_pretrained``) holds the model's tokenizer when one is attached (``model.tokenizer``):
``tokenizer.json`` (the ``tokenizers`` file; for bytes an equivalent byte-level file, so ``AutoTokenizer`` works),
``tokenizer_config.json`` (special tokens, left padding) and ``elastic_tokenizer.json`` (our spec, read by
``load_tokenizer``). ``config.json`` records ``tokenizer_record(tok)``: type, V, special ids and a fingerprint
(SHA-256 of the serialized tokenizer; a constant for bytes). ``resolve_tokenizer(model, spec)`` gives the saved
tokenizer for no ``spec``, and refuses a ``spec`` whose vocabulary or fingerprint differs from it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from .tokenizers import META_FILE, SPECIAL_TOKENS, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_ROLES = ("bos", "eos", "pad", "sep")
BYTES_FINGERPRINT = hashlib.sha256(b"elastic_ssm.ByteTokenizer:bytes0-255+pad,bos,eos,sep").hexdigest()

__all__ = ["fingerprint", "tokenizer_record", "save_tokenizer_files", "load_saved_tokenizer", "resolve_tokenizer",
           "check_same_tokenizer", "byte_level_tokenizer"]


def fingerprint(tok: Tokenizer) -> str:
    """SHA-256 of the serialized tokenizer (BPE) or a constant (bytes): equal fingerprints encode alike."""
    return BYTES_FINGERPRINT if isinstance(tok, ByteTokenizer) else tok.sha256


def tokenizer_record(tok: Tokenizer) -> dict[str, Any]:
    """What ``config.json`` records of the model's tokenizer."""
    return {"type": "bytes" if isinstance(tok, ByteTokenizer) else "bpe", "vocab_size": int(tok.vocab_size),
            "fingerprint": fingerprint(tok), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
            "pad_token_id": tok.pad_id, "sep_token_id": tok.sep_id}


def _byte_chars() -> list[str]:
    """The printable stand-in character of every byte used by byte-level BPE files (byte b -> chars[b]):
    printable Latin-1 bytes stand for themselves, the others take code points 256, 257, ... in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to ``ByteTokenizer``: id = byte value, specials at 256..259."""
    from .tokenizers import _import_tokenizers

    tk = _import_tokenizers()
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _token_name(tok: Tokenizer, token_id: int) -> str:
    if isinstance(tok, ByteTokenizer):
        return SPECIAL_TOKENS[token_id - ByteTokenizer.PAD]
    return tok._tok.id_to_token(token_id)


def save_tokenizer_files(tok: Tokenizer, directory: str | Path) -> list[str]:
    """Write the tokenizer files into ``directory`` (each atomically, mode 0644 under umask 022).

    Returns the names written. The byte tokenizer's ``tokenizer.json`` needs the ``tokenizers`` package;
    without it only ``elastic_tokenizer.json`` is written (enough for this library's own loaders)."""
    from ..utils.files import atomic_write_bytes

    directory = Path(directory)
    written = []
    text = None
    if isinstance(tok, BPETokenizer):
        text = tok._tok.to_str(pretty=True)
    else:
        try:
            text = byte_level_tokenizer().to_str(pretty=True)
        except ImportError:
            text = None
    if text is not None:
        atomic_write_bytes(directory / TOKENIZER_FILE, text.encode("utf-8"))
        written.append(TOKENIZER_FILE)
        hf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "padding_side": "left",
              **{f"{role}_token": _token_name(tok, getattr(tok, f"{role}_id")) for role in ("bos", "eos", "pad")},
              "sep_token": _token_name(tok, tok.sep_id)}
        atomic_write_bytes(directory / TOKENIZER_CONFIG_FILE, (json.dumps(hf, indent=2) + "\n").encode())
        written.append(TOKENIZER_CONFIG_FILE)
    meta = {"type": "bytes", "vocab_size": tok.vocab_size} if isinstance(tok, ByteTokenizer) else \
        {"type": "bpe", "file": TOKENIZER_FILE, "vocab_size": tok.vocab_size}
    meta.update(specials={r: getattr(tok, f"{r}_id") for r in ("pad", "bos", "eos", "sep")}, sha256=fingerprint(tok))
    atomic_write_bytes(directory / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    written.append(META_FILE)
    return written


def _name_missing_file(directory: Path, record: dict[str, Any] | None, has_meta: bool, has_file: bool) -> None:
    """``FileNotFoundError`` naming the one tokenizer file a model directory lacks, when ``config.json``'s
    ``record`` says which it needs: a byte model reads ``elastic_tokenizer.json`` (its ``tokenizer.json`` is
    for transformers), a BPE model ``tokenizer.json``. Without this the other file loaded, or the error named
    both, and the message blamed a replaced tokenizer."""
    kind = (record or {}).get("type")
    missing = META_FILE if kind == "bytes" and not has_meta else TOKENIZER_FILE if kind == "bpe" and not has_file \
        else None
    if missing is not None:
        raise FileNotFoundError(f"{directory / missing} is missing: this model's {kind} tokenizer is read from it; "
                                "restore it from where the model was saved")


def load_saved_tokenizer(directory: str | Path, record: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer saved in a model directory (None when there is none).

    With ``record`` (from ``config.json``), a tokenizer whose fingerprint differs from the recorded one is
    a ``ValueError``: the tokenizer files were replaced after the model was saved."""
    directory = Path(directory)
    has_meta, has_file = (directory / META_FILE).is_file(), (directory / TOKENIZER_FILE).is_file()
    if not has_meta and not has_file:
        return None
    _name_missing_file(directory, record, has_meta, has_file)
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


def _describe(tok: Tokenizer) -> str:
    return f"{tok.spec} (vocabulary {tok.vocab_size}, fingerprint {fingerprint(tok)[:12]})"


def check_same_tokenizer(given: Tokenizer, saved: Tokenizer | dict[str, Any], where: str) -> None:
    """A ``ValueError`` (one line) when ``given`` differs from the model's saved tokenizer (or its record)."""
    rec = tokenizer_record(saved) if not isinstance(saved, dict) else saved
    if given.vocab_size != rec.get("vocab_size") or fingerprint(given) != rec.get("fingerprint"):
        raise ValueError(f"--tokenizer {_describe(given)} is not the tokenizer saved with {where} "
                         f"(vocabulary {rec.get('vocab_size')}, fingerprint {str(rec.get('fingerprint'))[:12]}); "
                         "leave --tokenizer out to use the saved one")


def _why_not_loaded(record: dict[str, Any], where: str, directory: Any) -> str:
    """Why a model's recorded tokenizer is absent: its files are missing from the model's folder, or the
    ``tokenizers`` package that reads them is not installed."""
    folder = Path(directory) if directory else None
    if folder is not None and folder.is_dir() and not any((folder / f).is_file() for f in (META_FILE, TOKENIZER_FILE)):
        return (f"the tokenizer recorded in {folder / 'config.json'} ({record.get('type')}, vocabulary "
                f"{record.get('vocab_size')}) has no files in {folder} ({META_FILE}, {TOKENIZER_FILE}): copy them back "
                "from where the model was saved, or pass --tokenizer with the tokenizer it was trained with")
    return (f"the tokenizer saved with {where} could not be loaded (a {record.get('type')} tokenizer needs the "
            "`tokenizers` package: pip install 'elastic-ssm[data]')")


def resolve_tokenizer(model: Any, spec: Any = None) -> Tokenizer:
    """The tokenizer to use with ``model``: the saved one by default; ``spec`` must match it when given.

    A model without a saved tokenizer (written before tokenizers travelled, or built in Python without
    one) uses ``spec``, else bytes; a tokenizer with more ids than the model's vocabulary is refused."""
    saved = getattr(model, "tokenizer", None)
    record = getattr(model, "tokenizer_record", None)
    where = f"the model {getattr(model, 'name_or_path', None) or '(in memory)'}"
    if spec is None or spec == "":
        if saved is not None:
            return saved
        if record is not None:
            raise ValueError(_why_not_loaded(record, where, getattr(model, "name_or_path", None)))
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
