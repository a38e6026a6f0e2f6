"""Derive argparse flags from config dataclasses (DESIGN rule 4: no hand-kept flag lists).

Every field of a ``ConfigBase`` subclass becomes ``--<prefix>.<field>`` with the field's ``help``;
tuples take several values, booleans get ``--x/--no-x``. ``collect_overrides`` returns only the flags
the user actually gave, so YAML files and presets supply everything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, prefix: str,
                        skip: set[str] | None = None) -> set[str]:
    """Add one flag per field of ``cls`` (defaults suppressed: absent flags do not override).

    Fields named in ``skip`` are left out (already added for another class); returns the added names.
    """
    group = parser.add_argument_group(f"{prefix} ({cls.__name__})")
    hints = typing.get_type_hints(cls)
    added = set()
    for f in dataclasses.fields(cls):
        if skip and f.name in skip:
            continue
        added.add(f.name)
        tp = _base_type(hints[f.name])
        flag = f"--{prefix}.{f.name}"
        help_ = f.metadata.get("help", "").replace("%", "%%")
        if f.default is not dataclasses.MISSING:
            help_ += f" (default: {f.default!r})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f"{prefix}.{f.name}", "help": help_, "default": argparse.SUPPRESS}
        if dataclasses.is_dataclass(tp):
            continue  # nested sections are configured through YAML
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
    """The ``--<prefix>.<field>`` values given on the command line, as a dict of field -> value."""
    out = {}
    for key, value in vars(ns).items():
        if key.startswith(prefix + "."):
            v = tuple(value) if isinstance(value, list) else value
            out[key[len(prefix) + 1:]] = v
    return out
