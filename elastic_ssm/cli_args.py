"""Derive argparse flags from config dataclasses (DESIGN rule 4: no hand-kept flag lists).

Every field of a ``ConfigBase`` subclass becomes ``--<prefix>.<field>`` with the field's ``help``;
tuples take several values, booleans get ``--x/--no-x``. ``collect_overrides`` returns only the flags
the user actually gave, so YAML files and presets supply everything else.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import types
import typing
from typing import Any

from .config import ConfigError


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, prefix: str,
                        skip: set[str] | None = None, aliases: dict[str, str] | None = None) -> set[str]:
    """Add one flag per field of ``cls`` (defaults suppressed: absent flags do not override); a nested section
    (a dataclass field) gets ``--<prefix>.<section>.<field>`` flags, recursively.

    Fields named in ``skip`` are left out (already added for another class); returns the added names. A field
    path with an old name in ``cls.FLAT_NAMES`` (``optim.lr`` <- ``lr``) also answers to ``--<prefix>.<old>``.
    """
    group = parser.add_argument_group(f"{prefix} ({cls.__name__})")
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
            add_dataclass_flags(parser, tp, f"{prefix}.{f.name}", aliases=sub)
            continue
        help_ = f.metadata.get("help", "").replace("%", "%%")
        if f.default is not dataclasses.MISSING:
            help_ += f" (default: {f.default!r})".replace("%", "%%")
        for flag, shown in ((f"--{prefix}.{f.name}", help_), (aliases.get(f.name), argparse.SUPPRESS)):
            if flag is None:
                continue                                   # the old flat name is accepted, not listed
            kw: dict[str, Any] = {"dest": f"{prefix}.{f.name}", "help": shown, "default": argparse.SUPPRESS}
            if tp is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            elif typing.get_origin(tp) is tuple:
                (item,) = typing.get_args(tp)[:1]
                group.add_argument(flag, nargs="+", type=_parse_scalar(item), **kw)
            else:
                group.add_argument(flag, type=_parse_scalar(tp), **kw)
    return added


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
    out = {}
    for key, value in vars(ns).items():
        if key.startswith(prefix + "."):
            v = tuple(value) if isinstance(value, list) else value
            out[key[len(prefix) + 1:]] = v
    return out


# ---- the device of the evaluating / generating verbs ----------------------------------------------------
DEVICE_HELP = "auto (cuda when a GPU is present, else cpu), cpu, cuda or cuda:N"


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def resolve_device(spec: str) -> str:
    """``--device`` -> a torch device string; a one-line ConfigError for a device this machine lacks."""
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise ConfigError(f"--device {spec!r} is not a device ({DEVICE_HELP})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {spec}: CUDA is not available on this machine; use --device cpu (or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {spec}: only cpu and cuda are supported")
    return spec


def announce_device(verb: str, device: str, dtype) -> None:
    """One line on stderr naming where and in which dtype a verb runs (stdout stays the verb's output)."""
    import sys

    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    print(f"{verb}: {device} ({name}), weights {str(dtype).replace('torch.', '')}", file=sys.stderr)


# ---- tier lists and CSV output of the evaluating verbs ---------------------------------------------------
def tier_names(spec: str) -> list[str] | None:
    """``--tiers``: None for 'all' (the model's whole tier table), else the comma-separated names."""
    return None if spec == "all" else spec.split(",")


def checked_tiers(model, spec: str) -> list[str] | None:
    """``_tier_names`` with every name resolved against the model first (an unknown tier is named before any
    work starts)."""
    names = tier_names(spec)
    return None if names is None else [model.resolve_tier(n).name for n in names]


def checked_capacities(model, spec: str) -> list | None:
    """``eval --tiers``: None for 'all', else one ``Tier`` per comma-separated entry, each a tier name (T4; K8 for
    ES-SSM, or a budget 8) or, for ESSH, a capacity fraction in (0, 1] through the two-rate map (Eq. 7). A value that is
    neither is a one-line ``ConfigError`` naming it and the valid range."""
    names = tier_names(spec)
    if names is None:
        return None
    out = []
    for raw in names:
        name = raw.strip()
        try:
            out.append(model.resolve_tier(int(name) if name.isdigit() and model.arch != "essh" else name))
            continue
        except ValueError as e:
            named_error = e
        try:
            xi = float(name)
        except ValueError:
            raise ConfigError(f"--tiers {name!r} is neither a tier name nor a number: {named_error}; or give a "
                              "capacity fraction in (0, 1], e.g. 0.45") from None
        if model.arch != "essh":
            raise ConfigError(f"--tiers {name}: capacity fractions are the ESSH two-rate map; this "
                              f"{model.arch!r} model takes tier names ({named_error})")
        if not 0 < xi <= 1:   # also NaN
            raise ConfigError(f"--tiers {name}: a capacity fraction must lie in (0, 1] (0 < xi <= 1)")
        out.append(model.resolve_tier(xi))
    return out


def write_csv(path: str | None, rows: list[dict]) -> None:
    """``rows`` (dicts with the same keys) as a CSV file at ``path``; nothing when ``path`` is None."""
    if not path:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
