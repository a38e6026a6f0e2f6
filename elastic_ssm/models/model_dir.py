"""A saved model directory's record: ``config.json`` checked for shape, the weights' checksums (sha256 of 64 MiB
pieces, hashed in parallel; docs/training.md, "Integrity"), the tier a directory answers to and its saved tokenizer
(``models/base.py`` writes and loads the directory).

Its remote-code files: transformers loads the directory with ``trust_remote_code=True`` alone. ``config.json``'s
``auto_map`` (``hf_keys``) names two thin modules written beside it; each imports its class from the installed
``elastic_ssm.hf`` (no frozen copy of the model code), so a fresh process needs no ``import elastic_ssm.hf``. Every
language model has its entry in ``FAMILIES`` (an ES-SSM classifier has none)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from ..config import TierLike
from ..elastic import tiers as tiers_mod

__all__ = ["FORMAT_VERSION", "WEIGHTS_NAME", "CONFIG_NAME", "CheckpointError", "read_model_meta", "file_sha256",
           "verify_sha256", "export_tier_aliases", "PIECE_BYTES", "piece_digests", "file_piece_digests",
           "pieces_record", "mismatched_piece", "PendingCheck", "check_config_fits_weights", "FAMILIES", "Family",
           "auto_map", "hf_keys", "remote_code"]


FORMAT_VERSION = 1
PIECE_BYTES = 1 << 26
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: the JSON types of the other keys of ``config.json`` that loading reads (each optional)
RECORD_TYPES: dict[str, type] = {"format_version": int, "source": dict, "tokenizer": dict, "weights_bytes": int,
                                 "weights_sha256": str, "weights_sha256_pieces": dict}
_JSON_NAMES = {int: "an integer", dict: "an object", str: "a string"}


class CheckpointError(RuntimeError):
    """A saved model directory is missing, corrupted or does not match its config."""


def read_model_meta(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` record of a model directory written by ``save_pretrained``, checked for shape: a
    mapping with ``format: elastic_ssm``, a string ``arch`` and a ``config`` mapping. A missing or empty path, a
    file where the folder belongs, an unreadable or malformed ``config.json`` is a ``CheckpointError`` naming it."""
    if not str(path).strip():
        raise CheckpointError("the model directory is an empty string; give a directory written by save_pretrained")
    path = Path(path)
    cfile = path / CONFIG_NAME
    if path.is_file():
        raise CheckpointError(f"{path} is a file; give the model directory (written by save_pretrained) that "
                              f"holds {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not cfile.is_file():
        inside = _model_inside(path) if path.is_dir() else None
        if inside is not None:
            raise CheckpointError(f"{path} has no {CONFIG_NAME}: {inside}")
        what = "does not exist" if not path.exists() else f"has no {CONFIG_NAME}"
        raise CheckpointError(f"{path} {what}; expected a model directory ({CONFIG_NAME} + {WEIGHTS_NAME}) written "
                              "by save_pretrained (a training run keeps its final model in <out_dir>/final)")
    try:
        meta = json.loads(cfile.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfile} is not valid JSON ({e}); the file is corrupted: save the model again") from e
    if not isinstance(meta, dict) or meta.get("format") != "elastic_ssm" or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{cfile} is not an elastic_ssm model record (a JSON object with format "
                              "'elastic_ssm' and a config mapping); give a directory written by save_pretrained")
    if not isinstance(meta.get("arch"), str) or not meta["arch"]:
        raise CheckpointError(f"{cfile} names no model arch ('arch': essh, es_ssm, transformer or matformer); "
                              "the file is corrupted: save the model again")
    _check_record_fields(cfile, meta)
    return meta


def _check_record_fields(cfile: Path, meta: dict[str, Any]) -> None:
    """A ``CheckpointError`` naming ``cfile`` when a key that loading reads holds another JSON type than
    ``save_pretrained`` writes (``RECORD_TYPES``), the weights' piece digests are malformed, or the record is of a
    newer format than this library reads."""
    for key, kind in RECORD_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise CheckpointError(f"{cfile}: '{key}' holds {type(value).__name__} {str(value)[:40]!r} where "
                                  f"save_pretrained writes {_JSON_NAMES[kind]}; the file is corrupted or was "
                                  "edited by hand: save the model again")
    pieces = meta.get("weights_sha256_pieces")
    if pieces is not None and not (isinstance(pieces.get("piece_bytes"), int) and pieces["piece_bytes"] > 0
                                   and isinstance(pieces.get("digests"), list)):
        raise CheckpointError(f"{cfile}: 'weights_sha256_pieces' needs a positive 'piece_bytes' and a 'digests' "
                              "list; the file is corrupted or was edited by hand: save the model again")
    if meta.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(f"{cfile} is of format version {meta['format_version']}, newer than the "
                              f"{FORMAT_VERSION} this elastic_ssm reads: upgrade elastic_ssm to load it")


def check_config_fits_weights(config: Any, wfile: Path) -> None:
    """Refuse a ``config`` needing more parameters than ``wfile``'s header holds values, before the model is built
    (an edited ``d_model`` or ``n_layers`` overflowed torch or built layers for minutes); a bad header: the load's."""
    from ..elastic.slicing import parse_header

    held = sum(math.prod(v[1]) for v in parsed[1].values()) if (parsed := parse_header(wfile)) else math.inf
    if (needed := tiers_mod.num_parameters(config)) > held:
        raise CheckpointError(f"{wfile.parent / CONFIG_NAME}: its model config needs {needed:,} parameters but "
                              f"{wfile} holds {held:,} values; the config was edited by hand or belongs to another "
                              "model: save the model again")


def _model_inside(path: Path) -> str | None:
    """Where the model is when ``path`` is a training run or one of its checkpoints (a run's ``final/``, a
    checkpoint's ``model/``, an unfinished run's newest checkpoint's), said as the end of an error; else None."""
    if (path / "final" / CONFIG_NAME).is_file():
        return f"it is a training run; its model is {path / 'final'}"
    if (path / "model" / CONFIG_NAME).is_file():
        return f"it is a training checkpoint; its model is {path / 'model'}"
    saved = sorted((f for f in path.glob(f"*/step_*/model/{CONFIG_NAME}")   # complete ones (train/checkpoint.py)
                    if (f.parent.parent / "COMPLETE.json").is_file()), key=lambda f: f.stat().st_mtime)
    return f"it is an unfinished training run; its newest complete checkpoint's model is {saved[-1].parent}" \
        if saved else None


def file_sha256(path: str | Path, chunk: int = 1 << 26) -> str:
    """The sha256 hex digest of a file, read in ``chunk``-byte pieces (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def piece_digests(data: bytes | memoryview, piece: int = PIECE_BYTES) -> list[str]:
    """sha256 hex digests of ``data[i * piece:(i + 1) * piece]``, hashed on several threads."""
    view = memoryview(data)
    with ThreadPoolExecutor(_workers()) as pool:
        return list(pool.map(lambda s: hashlib.sha256(view[s:s + piece]).hexdigest(), range(0, len(view), piece)))


def file_piece_digests(path: str | Path, piece: int = PIECE_BYTES) -> list[str]:
    """The same digests of a file's bytes, each piece read (``os.pread``) and hashed on its own thread."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(_workers()) as pool:
            return list(pool.map(lambda s: hashlib.sha256(os.pread(fd, piece, s)).hexdigest(), range(0, size, piece)))
    finally:
        os.close(fd)


def pieces_record(data: bytes | memoryview) -> dict:
    """What ``config.json`` stores under ``weights_sha256_pieces``."""
    return {"piece_bytes": PIECE_BYTES, "digests": piece_digests(data)}


def mismatched_piece(path: str | Path, record: dict) -> tuple[int, int] | None:
    """The byte range [start, end) of the first piece whose digest differs from ``record``; None if all match."""
    piece = int(record["piece_bytes"])
    got, want, size = file_piece_digests(path, piece), list(record["digests"]), os.path.getsize(path)
    if len(got) != len(want):
        return (0, size)
    return next(((i * piece, min((i + 1) * piece, size)) for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


class PendingCheck:
    """A weights checksum running on a thread (``from_pretrained(defer_verify=True)``): a deep copy of the model
    shares it, and pickling waits for it and stores nothing of it."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def result(self) -> None:
        self.future.result()

    def __deepcopy__(self, memo: dict) -> PendingCheck:
        return self

    def __reduce__(self):
        self.future.result()
        return (type(None), ())


def verify_sha256(path: str | Path, expected: str | None, pieces: dict | None = None) -> None:
    """Raise ``CheckpointError`` naming ``path`` when its bytes differ from what was written: by the piece
    digests when given (``mismatched_piece``, parallel), else by the whole-file sha256 ``expected``
    (None: unchecked)."""
    if pieces:
        bad = mismatched_piece(path, pieces)
        if bad is not None:
            raise CheckpointError(f"{path}: sha256 checksum mismatch in bytes {bad[0]}..{bad[1]} (the bytes changed "
                                  "after they were written: disk or copy corruption); restore the file from a good "
                                  "copy or save the model again")
        return
    if expected and file_sha256(path) != expected:
        raise CheckpointError(f"{path}: sha256 checksum mismatch (the bytes changed after they were written: disk "
                              "or copy corruption); restore the file from a good copy or save the model again")


def _exported_tier(source: dict[str, Any]) -> str | None:
    """The source tier's name when ``source`` (``config.json``'s record) is that of a standalone export."""
    return source.get("tier") if source.get("parent_config") else None


def _old_export_alias(config: Any, source: dict[str, Any], tier: TierLike) -> TierLike:
    """``tier``, or None (the whole model) when it names the source tier of a standalone export written before
    configs kept ``tier_names``: such an export (``exports/T4``) calls its one tier T1 and answers to both names,
    when it is loaded (``_tier_of_directory``) and in every verb that resolves a tier on the loaded model
    (``eval --tiers T4``, ``serve --tiers T4``)."""
    exported = _exported_tier(source)
    one = len(tiers_mod.tier_table(config)) == 1 and not getattr(config, "tier_names", None)
    return None if one and exported and isinstance(tier, str) and tier.strip() == exported else tier


def export_tier_aliases(model: Any) -> dict[str, str]:
    """``{source tier name: its one tier's name}`` for an older export (``_old_export_alias``), else ``{}``: the
    names a server accepts for such an export beside its own (``serve/schema.resolve_model_field``)."""
    source = dict(getattr(model, "source", None) or {})
    exported = _exported_tier(source)
    if exported and _old_export_alias(model.config, source, exported) is None:
        return {exported: tiers_mod.tier_table(model.config)[0].name}
    return {}


def _tier_of_directory(config: Any, tier: TierLike, source: dict[str, Any], path: Path) -> tiers_mod.Tier | None:
    """``tier`` of the saved ``config``; None (the whole model, its ``source`` kept) when the directory is a
    standalone export and ``tier`` names its full model (``exports/T4`` loaded with ``tier="T4"``, also an older
    export: ``_old_export_alias``). Any other unknown name is the config's ``ValueError``, which for an export
    also says what the directory holds."""
    exported = _exported_tier(source)
    if _old_export_alias(config, source, tier) is None:     # an older export's source name: its whole model
        return None
    try:
        t = tiers_mod.resolve_tier(config, tier)
    except ValueError as e:
        if exported is not None:
            raise ValueError(f"{e}; {path} is a standalone export of tier {exported}: load it whole (no tier, or "
                             f"tier={exported!r})") from None
        raise
    return None if exported is not None and t == tiers_mod.tier_table(config)[-1] else t


def _saved_tokenizer(path: Path, record: dict[str, Any] | None) -> Any:
    """The tokenizer saved in ``path``; None (with a warning) when it needs a package that is missing."""
    from ..data.tokenizers import load_saved_tokenizer

    try:
        return load_saved_tokenizer(path, record)
    except ImportError as e:
        warnings.warn(f"{path}: the saved tokenizer was not loaded ({e})", stacklevel=3)
        return None


class Family(NamedTuple):
    """How one architecture appears to transformers: its ``model_type``, the two classes and where they live."""

    model_type: str
    config_class: str
    model_class: str
    module: str          # the module of elastic_ssm that defines both classes


#: arch (``ElasticModel.arch``) -> its transformers family
FAMILIES: dict[str, Family] = {
    "essh": Family("essh", "ESSHHFConfig", "ESSHForCausalLM", "elastic_ssm.hf.modeling"),
    "es_ssm": Family("es_ssm", "ESSSMHFConfig", "ESSSMForCausalLM", "elastic_ssm.hf.families"),
    "transformer": Family("transformer_pp", "TransformerPPHFConfig", "TransformerPPForCausalLM",
                          "elastic_ssm.hf.families"),
    "matformer": Family("matformer", "MatFormerHFConfig", "MatFormerForCausalLM", "elastic_ssm.hf.families"),
}

_HEAD = '''"""Remote code of an elastic_ssm model directory, written by save_pretrained. transformers imports this file
for from_pretrained(dir, trust_remote_code=True); the class comes from the installed elastic_ssm package
(pip install "elastic-ssm[hf]"), so the directory holds no second copy of the model code."""

'''


def auto_map(arch: str) -> dict[str, str]:
    """``config.json``'s ``auto_map`` of ``arch``: the Auto class -> ``module.Class`` in the directory."""
    f = FAMILIES[arch]
    return {"AutoConfig": f"configuration_{f.model_type}.{f.config_class}",
            "AutoModelForCausalLM": f"modeling_{f.model_type}.{f.model_class}"}


def remote_code(arch: str) -> dict[str, str]:
    """File name -> text of the two modules ``auto_map(arch)`` names."""
    f = FAMILIES[arch]
    return {
        f"configuration_{f.model_type}.py": f'{_HEAD}from {f.module} import {f.config_class}\n\n'
                                            f'__all__ = ["{f.config_class}"]\n',
        f"modeling_{f.model_type}.py": f'{_HEAD}from {f.module} import {f.model_class}, {f.config_class}\n\n'
                                       f'__all__ = ["{f.model_class}", "{f.config_class}"]\n',
    }


def hf_keys(model: Any) -> dict[str, Any]:
    """The ``config.json`` keys that let transformers read ``model``'s directory (none for a model without a
    family, such as an ES-SSM classifier)."""
    if model.arch not in FAMILIES or getattr(model.config, "task", "lm") != "lm":
        return {}
    f = FAMILIES[model.arch]
    return {"model_type": f.model_type, "architectures": [f.model_class], "auto_map": auto_map(model.arch)}
