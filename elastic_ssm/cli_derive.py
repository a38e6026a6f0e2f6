"""``to_argv`` / ``derive``: a parent hands an options dataclass to a helper process as flags, which it parses by
tyro; apart from ``cli.py`` so that the bench package never imports the CLI."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .cli_util import CommandLineError, parse_error

__all__ = ["derive", "to_argv"]


def to_argv(options: Any, prefix: str = "") -> list[str]:
    """The flags of ``options`` (a dataclass instance) for a child process that parses them with ``derive``
    (booleans as ``--x`` / ``--no_x``, tuples as several values, ``None`` left out)."""
    out: list[str] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            out += to_argv(value, f"{prefix}{f.name}.")
        elif isinstance(value, bool):
            out.append(f"--{prefix}{f.name}" if value else f"--{prefix}no_{f.name}")
        elif isinstance(value, tuple):
            out += [f"--{prefix}{f.name}", *map(str, value)]
        elif value is not None:
            out += [f"--{prefix}{f.name}", str(value)]
    return out


def derive(cls: type, argv: list[str] | None, prog: str, description: str = "") -> Any:
    """``cls`` (an options dataclass) from ``argv`` by tyro, a mistake one line and exit code 2, as in
    ``elastic-ssm``: the helper processes' entry (``elastic_ssm.bench.serve_server``, ``benchmarks.first_token``...)."""
    import tyro
    from tyro._errors import on_parse_error

    try:
        with on_parse_error(parse_error):
            return tyro.cli(cls, args=argv, prog=prog, description=description, use_underscores=True)
    except CommandLineError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
