"""The tokenizer inside a model directory (files: ``tokenizers.save_tokenizer_files``): ``config.json`` records
``tokenizer_record(tok)`` (type, V, special ids, fingerprint); ``load_saved_tokenizer`` checks the files against it;
``resolve_tokenizer(model, spec)`` gives the saved tokenizer, and refuses a ``spec`` that differs from it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .tokenizers import (
    META_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    fingerprint,
    load_tokenizer,
    save_tokenizer_files,
)

SPECIAL_ROLES = ("bos", "eos", "pad", "sep")

__all__ = ["fingerprint", "tokenizer_record", "save_tokenizer_files", "load_saved_tokenizer", "resolve_tokenizer",
           "check_same_tokenizer"]


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
