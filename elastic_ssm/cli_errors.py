"""Error reporting of the command line: one line naming the problem and the fix, exit code 2.

``run_reporting_errors`` runs a subcommand: a user's mistake (``ConfigError`` and other ``ValueError``,
``OSError`` such as a read-only or full disk or a path that is a file, YAML syntax, a corrupt tokenizer,
an offline ``hf:`` source, ``FloatingPointError`` of a diverged run, out of memory) becomes one line on
stderr and exit code 2; anything else is one line that says it is probably a bug (exit code 1). With
``--debug`` or ``ELASTIC_SSM_DEBUG=1`` the exception propagates with its traceback. ``Parser`` makes
argparse's own errors (unknown flag, unparsable value) one line too, and ``check_args`` rejects
out-of-range numeric options (``--batch-size 0``, ``--check-len 0``, a negative ``--bytes-per-token``)
before a subcommand runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ConfigError

__all__ = ["Parser", "check_args", "one_line", "run_reporting_errors"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage block is one ``--help`` away) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: numeric options of the subcommands and their smallest valid value (checked before a command runs)
_MINIMUM = {"check_len": 1, "seq_len": 1, "batch_size": 1, "batches": 1, "max_new_tokens": 0, "context": 1,
            "pairs": 1, "max_length": 1, "max_tokens": 0, "max_bytes": 0, "vocab_size": 1, "steps": 0,
            "train_len": 1, "first": 1}


def check_args(args: argparse.Namespace) -> None:
    """Reject out-of-range numeric options with a message naming the flag."""
    for name, low in _MINIMUM.items():
        value = getattr(args, name, None)
        if isinstance(value, int) and value < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    bpt = getattr(args, "bytes_per_token", None)
    if bpt is not None and not (math.isfinite(bpt) and bpt >= 0):
        raise ConfigError(f"--bytes-per-token must be a finite number >= 0 (0: automatic), got {bpt}")
    depths = getattr(args, "depths", None)
    if isinstance(depths, str):
        try:
            [float(d) for d in depths.split(",")]
        except ValueError:
            raise ConfigError(f"--depths must be comma-separated numbers in [0, 1], got {depths!r}") from None
    # output paths are checked before the work that produces them, so no result is computed and then lost
    csv = getattr(args, "csv", None)
    if csv and not Path(csv).resolve().parent.is_dir():
        raise ConfigError(f"--csv {csv}: the folder {Path(csv).resolve().parent} does not exist; create it first")
    if getattr(args, "command", None) == "export" and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; give a folder (one sub-folder per tier is written there)")


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


def run_reporting_errors(fn: Callable[[], Any], args: argparse.Namespace, debug: bool) -> int:
    """``check_args(args)`` then ``fn()``; the exit code, with errors reported as described above."""
    try:
        check_args(args)
        return int(fn() or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"elastic-ssm {args.command}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if debug:
            raise
        kind = "training diverged" if isinstance(e, FloatingPointError) else "error"
        text = one_line(e).removeprefix("training diverged: ")
        print(f"elastic-ssm {args.command}: {kind}: {text} (--debug shows the traceback)", file=sys.stderr)
        return 2
    except Exception as e:  # not a known user mistake: still one line, but say it looks like a bug
        if debug:
            raise
        print(f"elastic-ssm {args.command}: unexpected {type(e).__name__}: {one_line(e)} (probably a bug: rerun "
              "with --debug and report the traceback)", file=sys.stderr)
        return 1
