"""A user's mistake as one line naming the problem and the fix, and exit code 2 (``run_reporting_errors``); anything
else one line calling it a probable bug (exit code 1). ``--debug`` / ``ELASTIC_SSM_DEBUG=1``: the traceback instead.
Under torchrun a command-line or run-file mistake is said once (rank 0), other errors by each rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .cli_util import is_rank_zero
from .config import ConfigError

__all__ = ["CommandLineError", "one_line", "parse_error", "report", "run_reporting_errors"]


class CommandLineError(ConfigError):
    """The command line itself is wrong (an unknown flag, a value of the wrong type): argparse's exit code 2."""


def parse_error(event: Any) -> None:
    """tyro's hook for a command line it rejects (``tyro._errors.on_parse_error``): raise it as one
    ``CommandLineError`` naming the flag, instead of tyro's boxed report."""
    from tyro import _errors as ev

    def name(argument: Any) -> str:
        lowered = argument.lowered
        return str(lowered.metavar) if argument.is_positional() else lowered.name_or_flags[-1]

    if isinstance(event, ev.UnrecognizedArgs):
        text = f"unrecognized arguments: {' '.join(event.tokens)}"
    elif isinstance(event, ev.MissingArgs):
        text = "the following arguments are required: " + ", ".join(name(a.arg) for a in event.missing_arguments)
    elif isinstance(event, ev.InvalidChoice):
        text = f"{name(event.argument)}: invalid choice {event.value!r} (choose from {', '.join(event.choices)})"
    elif isinstance(event, ev.BadValue):
        text = f"{name(event.argument)}: " + ("expected more values" if event.offending_value is None else
                                              f"unexpected value {event.offending_value!r}")
    elif isinstance(event, ev.InstantiationFailure):        # an optional's message lists each member's failure
        message = event.message.partition("Got errors:")[0].strip().rstrip(".")
        text = message if event.argument is None else f"{name(event.argument)}: {message}"
    else:
        text = type(event).__name__
    raise CommandLineError(f"{' '.join(text.split())} (see {event.prog} --help)")


def one_line(e: BaseException) -> str:
    """The exception as one line: an ``OSError`` as ``<file>: <reason>`` (with a hint beyond a missing file or a
    denied permission), a YAML error with its line and column, ``MemoryError`` with what to make smaller."""
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


def report(command: str, text: str, every_rank: bool = False) -> None:
    """The error line of ``elastic-ssm <command>`` on stderr: by rank 0 only, or with ``every_rank`` by each rank
    (naming it) under torchrun."""
    try:                                            # the reporter must not fail on the variable it reports
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    if every_rank and world > 1:
        print(f"elastic-ssm {command} (rank {os.environ.get('RANK', '?')}): {text}", file=sys.stderr)
    elif is_rank_zero():
        print(f"{f'elastic-ssm {command}'.strip()}: {text}", file=sys.stderr)


def run_reporting_errors(fn: Callable[[], Any], command: str, debug: bool) -> int:
    """``fn()``'s exit code, errors reported as the module docstring says; ``debug``: ``--debug`` was given (the
    ``ELASTIC_SSM_DEBUG`` switch, ``utils.environment.env_flag``, turns it on too; garbage there is one line, exit
    code 2). Without it a warning is one line too (no source line)."""
    import warnings

    import yaml

    from .utils.environment import env_flag

    try:
        debug = debug or env_flag("ELASTIC_SSM_DEBUG")
    except ConfigError as e:
        report(command, f"error: {e}")
        return 2
    original = warnings.formatwarning
    if not debug:
        warnings.formatwarning = lambda message, category, *rest, **kw: (
            f"elastic-ssm {command}: {category.__name__}: {' '.join(str(message).split())}\n")
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        report(command, "interrupted")
        return 130
    except (ConfigError, ValueError, OSError, RuntimeError, yaml.YAMLError, ArithmeticError, ImportError,
            MemoryError) as e:
        if debug:
            raise
        kind = "training diverged" if isinstance(e, FloatingPointError) else "error"
        text = one_line(e).removeprefix("training diverged: ")
        report(command, f"{kind}: {text} (--debug shows the traceback)", every_rank=not isinstance(e, ConfigError))
        return 2
    except Exception as e:  # not a known user mistake: still one line, but say it looks like a bug
        if debug:
            raise
        report(command, f"unexpected {type(e).__name__}: {one_line(e)} (probably a bug: rerun with --debug and "
               "report the traceback)", every_rank=True)
        return 1
    finally:
        warnings.formatwarning = original
