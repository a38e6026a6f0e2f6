"""Error reporting of the command line: one line naming the problem and the fix, exit code 2.

``run_reporting_errors`` runs a subcommand: a user's mistake (``ConfigError`` and other ``ValueError``,
``OSError`` such as a read-only or full disk or a path that is a file, YAML syntax, a corrupt tokenizer,
an offline ``hf:`` source, ``FloatingPointError`` of a diverged run, out of memory) becomes one line on
stderr and exit code 2; anything else is one line that says it is probably a bug (exit code 1). With
``--debug`` or ``ELASTIC_SSM_DEBUG=1`` the exception propagates with its traceback. ``Parser`` makes
argparse's own errors (unknown flag, unparsable value) one line too, and ``check_args`` rejects
out-of-range numeric options (``--batch-size 0``, ``--check-len 0``, a negative ``--bytes-per-token``)
before a subcommand runs, naming the flag as the user spelled it (an older alias included). Under torchrun a
mistake in the command line or run file is reported once (rank 0); other errors by each rank, with its number.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli_args import check_csv_target, check_output_path, is_rank_zero, spelled
from .config import ConfigError

__all__ = ["Parser", "check_args", "one_line", "run_reporting_errors"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage block is one ``--help`` away) and exit code 2; under torchrun
    rank 0 says it (every rank parses the same command line). Flags must be written whole: no prefix
    abbreviations (``--train.st`` is an error, not ``--train.steps``), so a typo never picks another setting."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n" if is_rank_zero() else None)


def check_args(args: argparse.Namespace) -> None:
    """Reject bad options with a message naming the flag as the user wrote it, before the command runs.

    From the command's options dataclass (``cli_options.py``): an empty string, a non-finite number, a value
    below ``minimum`` or not above ``above``, an ``output`` path that cannot be written, and a ``--csv`` file that
    would replace something saved (``check_csv_target``)."""
    cls = getattr(args, "options_cls", None)
    for f in dataclasses.fields(cls) if cls is not None else ():
        meta, value = f.metadata, getattr(args, f.name, None)
        items = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(v, str) and not v.strip() for v in items):
            raise ConfigError(f"{spelled(args, f.name)} is an empty string; give a value (see --help)")
        numbers = [v for v in items if isinstance(v, int | float) and not isinstance(v, bool)]
        if any(not math.isfinite(v) for v in numbers):
            raise ConfigError(f"{spelled(args, f.name)} must be a finite number, got {value}")
        low, above = meta.get("minimum"), meta.get("above")
        if low is not None and any(v < low for v in numbers):
            raise ConfigError(f"{spelled(args, f.name)} must be >= {low}, got {value}")
        if above is not None and any(v <= above for v in numbers):
            raise ConfigError(f"{spelled(args, f.name)} must be > {above}, got {value}")
        high = meta.get("maximum")
        if high is not None and any(v > high for v in numbers):
            raise ConfigError(f"{spelled(args, f.name)} must be <= {high}, got {value}")
        if meta.get("output") and isinstance(value, str):
            check_output_path(spelled(args, f.name), value, meta["output"])
    csv = getattr(args, "csv", None)             # write_csv creates no folder
    if csv and not Path(csv).resolve().parent.is_dir():
        raise ConfigError(f"--csv {csv}: the folder {Path(csv).resolve().parent} does not exist; create it first")
    if csv:                                      # an existing file: refused now, not after the evaluation
        check_csv_target(csv, getattr(args, "overwrite", False))
    bpt = getattr(args, "bytes_per_token", None)
    if bpt is not None and not (math.isfinite(bpt) and bpt >= 0):
        raise ConfigError(f"--bytes-per-token must be a finite number >= 0 (0: automatic), got {bpt}")
    depths = getattr(args, "depths", None)
    if isinstance(depths, str):
        try:
            values = [float(d) for d in depths.split(",")]
        except ValueError:
            values = []
        if not values or not all(0 <= d <= 1 for d in values):   # also NaN
            raise ConfigError(f"--depths must be comma-separated numbers in [0, 1], got {depths!r}")


def one_line(e: BaseException) -> str:
    """The exception as one line naming the problem and, where the exception knows it, the fix.

    * ``OSError``: ``<file>: <reason>`` (plus a hint about the path, permissions and free space for the
      errors that are not a plain missing file or denied permission);
    * YAML errors: the line and column of the problem;
    * ``MemoryError``: what to make smaller;
    * anything else: its message, whitespace (including newlines of multi-line messages) collapsed.
    """
    import yaml

    if isinstance(e, OSError) and e.strerror and not isinstance(e, FileNotFoundError | PermissionError):
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        text += "" if e.filename is None else " (check the path, its permissions and the free disk space)"
    elif isinstance(e, OSError) and e.strerror and e.filename:
        text = f"{e.filename}: {e.strerror}"
    elif isinstance(e, yaml.YAMLError):
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        text = f"invalid YAML{where}: {getattr(e, 'problem', None) or e}; fix the file's syntax"
    elif isinstance(e, MemoryError):
        text = f"out of memory ({e or 'allocation failed'}); use a smaller model, batch or sequence length"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def _user_errors() -> tuple[type[BaseException], ...]:
    import yaml

    return (ConfigError, ValueError, OSError, RuntimeError, yaml.YAMLError, ArithmeticError, ImportError,
            MemoryError)


def _report(args: argparse.Namespace, text: str, every_rank: bool = False) -> None:
    """The error line on stderr. Under torchrun, a mistake in the command line or run file (the same on every
    rank) is said once, by rank 0; any other error by each rank that meets it, naming the rank."""
    try:                                            # the reporter must not fail on the variable it reports
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    if every_rank and world > 1:
        print(f"elastic-ssm {args.command} (rank {os.environ.get('RANK', '?')}): {text}", file=sys.stderr)
    elif is_rank_zero():
        print(f"elastic-ssm {args.command}: {text}", file=sys.stderr)


def debug_requested(flag: bool, args: argparse.Namespace) -> bool | None:
    """``--debug`` or the ``ELASTIC_SSM_DEBUG`` switch (``utils.env.env_flag``); None, after one line on stderr,
    when the variable holds something that is not a switch (the caller exits with 2)."""
    from .utils.env import env_flag

    try:
        return flag or env_flag("ELASTIC_SSM_DEBUG")
    except ConfigError as e:
        _report(args, f"error: {e}")
        return None


def run_reporting_errors(fn: Callable[[], Any], args: argparse.Namespace, debug: bool) -> int:
    """``check_args(args)`` then ``fn()``; the exit code, with errors reported as described above."""
    try:
        check_args(args)
        return int(fn() or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        _report(args, "interrupted")
        return 130
    except _user_errors() as e:
        if debug:
            raise
        kind = "training diverged" if isinstance(e, FloatingPointError) else "error"
        text = one_line(e).removeprefix("training diverged: ")
        _report(args, f"{kind}: {text} (--debug shows the traceback)", every_rank=not isinstance(e, ConfigError))
        return 2
    except Exception as e:  # not a known user mistake: still one line, but say it looks like a bug
        if debug:
            raise
        _report(args, f"unexpected {type(e).__name__}: {one_line(e)} (probably a bug: rerun with --debug and report "
                "the traceback)", every_rank=True)
        return 1
