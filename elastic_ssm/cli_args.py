"""Derive argparse flags from dataclasses (DESIGN rule 4: no hand-kept flag lists).

Two spellings, one function (``add_dataclass_flags``):

* config sections (``prefix`` given): every field of a ``ConfigBase`` subclass becomes
  ``--<prefix>.<field>`` with the field's ``help``; defaults are suppressed, so ``collect_overrides``
  returns only the flags the user gave and YAML files and presets supply everything else. ``defaults``
  (a config instance) makes ``--help`` show the values a run would really use;
* command options (no prefix, ``cli_options.py``): every field becomes ``--<field-with-dashes>`` (or a
  positional argument) whose default is the field's; ``flag()`` declares the extras (hidden aliases,
  choices, a minimum checked before the command runs).

In both, tuples take several values and booleans get ``--x/--no-x``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import types
import typing
from typing import Any

from .config import ConfigError, tier_word


def flag(default: Any = dataclasses.MISSING, help: str = "", *, aliases: tuple[str, ...] = (),
         choices: tuple | None = None, positional: bool = False, minimum: float | None = None,
         above: float | None = None, maximum: float | None = None, output: str | None = None,
         nargs: str | None = None, const: Any = None, metavar: str | None = None) -> Any:
    """A command-option field: its default (none: the flag is required), a one-line ``help``, and
    ``aliases`` (older spellings, accepted but hidden from ``--help``), ``choices``, ``positional`` (an
    argument without ``--``), ``minimum`` (value >= minimum), ``above`` (value > above), ``maximum``, ``output`` ("file"
    or "folder": a path the command writes, checked before any work), ``nargs`` / ``const`` (``--resume
    [auto]``) and ``metavar``. ``cli_errors.check_args`` checks them, and for every option that an empty string
    and a non-finite number (nan, inf) are refused."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a default of several values")
    if output not in (None, "file", "folder"):
        raise TypeError(f"output must be 'file' or 'folder', got {output!r}")
    meta = {"help": help, "aliases": aliases, "choices": choices, "positional": positional, "minimum": minimum,
            "above": above, "maximum": maximum, "output": output, "nargs": nargs, "const": const, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, prefix: str | None = None,
                        skip: set[str] | None = None, defaults: Any = None, source: str = "",
                        aliases: dict[str, str] | None = None) -> set[str]:
    """Add one flag per field of ``cls``; returns the added field names.

    With ``prefix`` (a config section): ``--<prefix>.<field>``, defaults suppressed (absent flags do not
    override); a nested section (a dataclass field) gets ``--<prefix>.<section>.<field>`` flags, recursively;
    fields named in ``skip`` are left out (already added for another class); ``defaults`` is the config whose
    values ``--help`` shows as the defaults (those of the run file ``source``; a field it lacks shows "from the
    preset"). A field path with an old name in ``cls.FLAT_NAMES`` (``optim.lr`` <- ``lr``) also answers to
    ``--<prefix>.<old>`` (hidden). Without ``prefix``: the command options of ``cls`` (``flag()`` fields).
    """
    if prefix is None:
        return _add_option_flags(parser, cls)
    where = f"; defaults: {source}" if source else ""
    group = parser.add_argument_group(f"{prefix} ({cls.__name__}{where})")
    hints = typing.get_type_hints(cls)
    if aliases is None:
        flat = getattr(cls, "FLAT_NAMES", {})
        aliases = {path: f"--{prefix}.{old}" for old, path in flat.items()}
    added = set()
    for f in dataclasses.fields(cls):
        if skip and f.name in skip:
            continue
        added.add(f.name)
        tp = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub = {k.partition(".")[2]: v for k, v in aliases.items() if k.startswith(f.name + ".")}
            add_dataclass_flags(parser, tp, f"{prefix}.{f.name}", defaults=getattr(defaults, f.name, None),
                                source=source, aliases=sub)
            continue
        help_ = f.metadata.get("help", "").replace("%", "%%")
        help_ += _default_text(f, defaults).replace("%", "%%")
        for flag_, shown in ((f"--{prefix}.{f.name}", help_), (aliases.get(f.name), argparse.SUPPRESS)):
            if flag_ is None:
                continue                                   # the old flat name is accepted, not listed
            kw: dict[str, Any] = {"dest": f"{prefix}.{f.name}", "help": shown, "default": argparse.SUPPRESS}
            if tp is bool:
                group.add_argument(flag_, action=argparse.BooleanOptionalAction, **kw)
            elif typing.get_origin(tp) is tuple:
                (item,) = typing.get_args(tp)[:1]
                action = _RecordedRepeatable if f.metadata.get("repeatable") else _Recorded
                group.add_argument(flag_, nargs="+", type=_parse_scalar(item), action=action, **kw)
            else:
                group.add_argument(flag_, type=_parse_scalar(tp), action=_Recorded, **kw)
    return added


def _default_text(f: dataclasses.Field, defaults: Any) -> str:
    """`` (default: X)``: the value in ``defaults`` when given (the run file's), else the class default."""
    if defaults is not None:
        if not hasattr(defaults, f.name):
            return " (default: from the preset)"
        value = getattr(defaults, f.name)
        return f" (default: {list(value) if isinstance(value, tuple) else value!r})"
    if f.default is not dataclasses.MISSING:
        return f" (default: {f.default!r})"
    return ""


class _Recorded(argparse.Action):
    """A config-section flag: stores its value and records the spelling it came with, so a setting given by its
    old flat name and by its section path with different values is refused (``collect_overrides``)."""

    repeatable = False

    def __call__(self, parser, namespace, values, option_string=None):
        given = dict(getattr(namespace, "_section_given", {}))
        mine = given.get(self.dest, {})
        if self.repeatable and option_string in mine:       # a repeatable list flag given again: values add up
            values = [*mine[option_string], *values]
        setattr(namespace, self.dest, values)
        given[self.dest] = {**mine, option_string: values}
        namespace._section_given = given


class _RecordedRepeatable(_Recorded):
    """A list flag of ``opt(..., repeatable=True)``: given twice, it keeps both lists (``--bench.set a=1
    --bench.set b=2`` sets a and b)."""

    repeatable = True


class _Alias(argparse.Action):
    """A hidden older spelling of a flag: stores like the flag and records the spelling for messages."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        spelled = dict(getattr(namespace, "_spelled", {}))
        spelled[self.dest] = option_string
        namespace._spelled = spelled


def _add_option_flags(parser: argparse.ArgumentParser, cls: type) -> set[str]:
    """``--field-name`` (or a positional) per field of the options dataclass ``cls``, default the field's."""
    hints = typing.get_type_hints(cls)
    own = [c for c in cls.__mro__ if dataclasses.is_dataclass(c)]
    fields = sorted(dataclasses.fields(cls),     # the command's own fields first, then the shared groups'
                    key=lambda f: next(i for i, c in enumerate(own) if f.name in vars(c).get("__annotations__", {})))
    for f in fields:
        meta = f.metadata
        tp = _base_type(hints[f.name])
        required = f.default is dataclasses.MISSING
        help_ = meta.get("help", "").replace("%", "%%")
        if not (required or meta.get("positional") or f.default is None or f.default is False or f.default == ""):
            help_ += f" (default: {f.default})".replace("%", "%%")
        kw: dict[str, Any] = {"help": help_}
        for key in ("choices", "nargs", "const", "metavar"):
            if meta.get(key) is not None:
                kw[key] = meta[key]
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_scalar(typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp)
            if typing.get_origin(tp) is tuple:
                kw.setdefault("nargs", "+")
        if meta.get("positional"):
            if not required:
                raise TypeError(f"{cls.__name__}.{f.name}: a positional argument takes no default")
            parser.add_argument(f.name, **kw)
            continue
        name = "--" + f.name.replace("_", "-")
        if required:
            parser.add_argument(name, dest=f.name, required=True, **kw)
        else:
            parser.add_argument(name, dest=f.name, default=f.default, **kw)
        for alias in meta.get("aliases") or ():
            alias_kw = {k: v for k, v in kw.items() if k not in ("help", "action")}
            if tp is bool:
                raise TypeError(f"{cls.__name__}.{f.name}: boolean flags take no aliases")
            parser.add_argument(alias, dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                action=_Alias, **alias_kw)
    return {f.name for f in dataclasses.fields(cls)}


def check_output_path(flag: str, path: str, kind: str) -> None:
    """An output ``path`` (``kind`` "file" or "folder") the command can create (missing folders above it are
    created): not the other kind of thing, and not below a file. Checked before the work that produces the
    output, so no result is computed and then lost."""
    from pathlib import Path

    p = Path(path)
    if kind == "file" and p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path")
    if kind == "folder" and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder (it is created if missing)")
    parent = p.resolve().parent if kind == "file" else p.resolve()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, so nothing can be written below it; choose another path")


def spelled(args: argparse.Namespace, name: str) -> str:
    """The flag of option ``name`` as the user wrote it (an alias such as ``--pairs`` if used); a positional
    argument by its ``--help`` name (``SOURCE``, ``MODEL_DIR``)."""
    cls = getattr(args, "options_cls", None)
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None) if cls is not None else None
    if field is not None and field.metadata.get("positional"):
        return field.metadata.get("metavar") or name.upper()
    return getattr(args, "_spelled", {}).get(name) or "--" + name.replace("_", "-")


def options(args: argparse.Namespace, cls: type) -> Any:
    """The options dataclass ``cls`` filled from the parsed ``args``."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _parse_scalar(tp: Any):
    if tp is float:
        def parse_float(s: str) -> float:
            if s.count("/") == 1:
                num, den = (float(x) for x in s.split("/"))
                if den == 0:
                    raise ValueError(f"{s}: division by zero")
                return num / den
            return float(s)
        return parse_float
    if tp in (int, str):
        return tp
    return str


def collect_overrides(ns: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The ``--<prefix>.<field>`` values given on the command line, as a dict of field -> value (a nested
    section's field as a dotted path, ``optim.lr``: ``ConfigBase.updated`` applies it)."""
    for dest, spellings in getattr(ns, "_section_given", {}).items():
        if dest.startswith(prefix + ".") and len(spellings) > 1 and len({repr(v) for v in spellings.values()}) > 1:
            (a, va), (b, vb) = list(spellings.items())[:2]
            raise ConfigError(f"{a} {va} and {b} {vb} name the same setting; give only --{dest}")
    out = {}
    for key, value in vars(ns).items():
        if key.startswith(prefix + "."):
            v = tuple(value) if isinstance(value, list) else value
            out[key[len(prefix) + 1:]] = v
    return out


def is_rank_zero() -> bool:
    """Whether this process prints status lines: rank 0 of a torchrun / ``torch.distributed`` job (``RANK``,
    or the initialised process group), or a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


# ---- the device of the evaluating / generating verbs ----------------------------------------------------
DEVICE_HELP = "auto (cuda when a GPU is present, else cpu), cpu, cuda or cuda:N"


def resolve_device(spec: str) -> str:
    """``--device`` -> a torch device string; a one-line ConfigError for a device this machine lacks."""
    import torch

    from .utils.devices import checked_device

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        checked_device(spec, "--device")
    except ValueError as e:
        raise ConfigError(f"{e} (or auto)") from None
    return spec


def resolve_dtype(name: str, device: str):
    """``--dtype`` -> the weights' torch dtype: auto = bfloat16 on CUDA (the fused decoder's format), float32
    elsewhere."""
    import torch

    return {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
            "bfloat16": torch.bfloat16}[name]


def status(*parts: Any, **kw: Any) -> None:
    """``print`` for status lines: only rank 0 of a torchrun job prints them."""
    if is_rank_zero():
        print(*parts, **kw)


def announce_device(verb: str, device: str, dtype) -> None:
    """One line on stderr naming where and in which dtype a verb runs (stdout stays the verb's output); under
    torchrun only rank 0 says it."""
    import torch

    if not is_rank_zero():
        return
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    print(f"{verb}: {device} ({name}), weights {str(dtype).replace('torch.', '')}", file=sys.stderr)


# ---- tier lists and CSV output of the evaluating verbs ---------------------------------------------------
def tier_names(spec: str) -> list[str] | None:
    """``--tiers``: None for 'all' (the model's whole tier table), else the comma-separated names, each stripped of
    spaces (``"T1, T4"`` is ``["T1", "T4"]``). The one parser of every verb's tier list."""
    spec = spec.strip()
    return None if spec == "all" else [name.strip() for name in spec.split(",")]


def listed_tier(name: str):
    """One entry of a tier list as ``resolve_tier`` takes it: ``full`` is the full model (None), as in generate's
    ``--tier``; anything else goes through ``tier_word`` (an ES-SSM budget ``8`` is an int)."""
    return None if name.strip().lower() == "full" else tier_word(name)


def checked_tiers(model, spec: str) -> list[str] | None:
    """``tier_names`` with every name resolved against the model first (an unknown tier is named before any
    work starts); ``full`` is the full tier, an ES-SSM budget ``8`` its tier ``K8`` (``listed_tier``)."""
    names = tier_names(spec)
    return None if names is None else [model.resolve_tier(listed_tier(n)).name for n in names]


def checked_capacities(model, spec: str, flag: str = "--tiers") -> list | None:
    """``eval --tiers``: None for 'all', else one ``Tier`` per comma-separated entry, each a tier name (T4; K8 for
    ES-SSM, or a budget 8) or, for ESSH, a capacity fraction in (0, 1] through the two-rate map (Eq. 7). A value that is
    neither is a one-line ``ConfigError`` naming it, the valid range and ``flag`` (the option as the user spelled
    it)."""
    names = tier_names(spec)
    if names is None:
        return None
    out = []
    for name in names:
        try:
            out.append(model.resolve_tier(listed_tier(name)))
            continue
        except ValueError as e:
            named_error = e
        try:
            xi = float(name)
        except ValueError:
            raise ConfigError(f"{flag} {name!r} is neither a tier name nor a number: {named_error}; or give a "
                              "capacity fraction in (0, 1], e.g. 0.45") from None
        if model.arch != "essh":
            raise ConfigError(f"{flag} {name}: capacity fractions are the ESSH two-rate map; this "
                              f"{model.arch!r} model takes tier names ({named_error})")
        if not 0 < xi <= 1:   # also NaN
            raise ConfigError(f"{flag} {name}: a capacity fraction must lie in (0, 1] (0 < xi <= 1)")
        out.append(model.resolve_tier(xi))
    return out


def refuse_existing(args: argparse.Namespace, *paths) -> None:
    """A one-line ``ConfigError`` when one of ``paths`` (the command's output ``args.out`` and its companions) exists
    and ``--overwrite`` was not given: what a user saved is never replaced silently."""
    found = [p for p in paths if p.exists()]
    if found and not args.overwrite:
        also = f" (and {', '.join(str(p) for p in found[1:])})" if len(found) > 1 else ""
        raise ConfigError(f"{spelled(args, 'out')} {found[0]} already exists{also}; pass --overwrite to replace "
                          f"{'them' if also else 'it'}, or choose another output path")


def check_csv_target(path: str, overwrite: bool, flag: str = "--csv") -> None:
    """Refuse a CSV output ``path`` that would replace something saved (``ConfigError``, one line): a folder; an
    existing file not named ``*.csv`` (a model's ``config.json``, weights, tokenizer or notes), even with
    ``overwrite``; an existing ``*.csv`` without ``overwrite``. The verbs call it before any work (``check_args``)
    and ``write_csv`` again before it writes, so the two always agree."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path")
    if not os.path.lexists(p):
        return
    if p.suffix.lower() != ".csv":
        raise ConfigError(f"{flag} {path} already exists and is not a .csv file (say a model's config.json); it is "
                          "never replaced, even with --overwrite: choose another path")
    if not overwrite:
        raise ConfigError(f"{flag} {path} already exists; pass --overwrite to replace it, or choose another path")


def write_csv(path: str | None, rows: list[dict], overwrite: bool = False, flag: str = "--csv") -> None:
    """``rows`` (dicts with the same keys) as a CSV file at ``path``, written atomically; nothing when ``path`` is
    None. An existing file is replaced only as ``check_csv_target`` allows (``overwrite``; ``flag`` names the
    option in its message)."""
    if not path:
        return
    import io

    from .utils.files import atomic_write_text

    check_csv_target(path, overwrite, flag)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())     # a crash or a full disk never leaves half a table
    status(f"wrote {path}")
