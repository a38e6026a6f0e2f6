"""What the verbs share: status lines, ``--device`` / ``--dtype``, tier lists, output checks and CSV writing, flags as
typed, ``to_argv`` / ``derive`` (a parent hands an options dataclass to a helper process as flags it parses
by tyro); and the one place a user's mistake becomes one line naming the problem and the fix, exit code 2
(``run_reporting_errors``; anything else one line calling it a probable bug, exit code 1; ``--debug`` /
``ELASTIC_SSM_DEBUG=1``: the traceback instead; under torchrun a command-line or run-file mistake is said once, by
rank 0, other errors by each rank). torch is imported only by the functions that need it."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import os
import re
import select
import sys
import warnings
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, tier_word
from .utils.environment import env_flag
from .utils.files import atomic_write_text


def spelled(args: argparse.Namespace, name: str) -> str:
    """The flag of option ``name`` as the user typed it (``--train.no_compile``), else ``--name``; a positional
    argument by its ``--help`` name (``MODEL_DIR``)."""
    return getattr(args, "_spelled", {}).get(name) or "--" + name


def overrides(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The ``--<section>.<field>`` flags given, as field path (``optim.lr``) -> parsed value."""
    return {path.partition(".")[2]: attrgetter(path)(args) for path in sorted(getattr(args, "_given", ()))
            if path.startswith(section + ".")}


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of a torchrun job (the process group, else ``RANK``) or a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


# ---- the device of the evaluating / generating verbs ----------------------------------------------------
DEVICE_HELP = "auto (cuda when a GPU is present, else cpu; never mps, which has no float64), cpu, cuda or cuda:N"


def resolve_device(spec: str, flag: str = "--device") -> str:
    """``--device`` (or the setting ``flag``) -> a torch device string (``ConfigError`` for one this machine lacks;
    ``auto`` says on stderr why a machine with MPS runs on the CPU)."""
    from .utils.environment import auto_device, checked_device

    if spec == "auto":
        device, note = auto_device()
        if note:
            status(note, file=sys.stderr)
        return device
    try:
        checked_device(spec, flag)
    except ValueError as e:
        raise ConfigError(f"{e} (or auto)") from None
    return spec


def load_model(args: argparse.Namespace, path: str | None = None, dtype: str | None = None, **kw: Any):
    """``(model, device)``: the model directory ``path`` (default: ``args.checkpoint``) loaded on ``--device``, its
    weights in the dtype ``dtype`` names (``--dtype``; None: as saved); ``kw``: ``load_pretrained``'s."""
    from .models import load_pretrained

    device = resolve_device(args.device)
    if dtype is not None:
        kw["dtype"] = resolve_dtype(dtype, device)
    return load_pretrained(path or args.checkpoint, device=device, **kw), device


def resolve_dtype(name: str, device: str):
    """``--dtype`` -> the weights' torch dtype (``DtypeOptions``)."""
    import torch

    return {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
            "bfloat16": torch.bfloat16}[name]


def status(*parts: Any, **kw: Any) -> None:
    """``print`` for status lines: only rank 0 of a torchrun job prints them."""
    if is_rank_zero():
        print(*parts, **kw)


def announce_device(verb: str, device: str, dtype) -> None:
    """One line on stderr (rank 0 only): where and in which dtype ``verb`` runs."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    status(f"{verb}: {device} ({name}), weights {str(dtype).replace('torch.', '')}", file=sys.stderr)


# ---- tier lists and CSV output of the evaluating verbs ---------------------------------------------------
def tier_names(spec: str) -> list[str] | None:
    """Every verb's ``--tiers`` parser: None for 'all', else the comma-separated names, stripped (``"T1, T4"``)."""
    spec = spec.strip()
    return None if spec == "all" else [name.strip() for name in spec.split(",")]


def listed_tier(name: str):
    """A tier-list entry for ``resolve_tier``: ``full`` -> None, else ``tier_word`` (an ES-SSM budget ``8``: int)."""
    return None if name.strip().lower() == "full" else tier_word(name)


def checked_tiers(model, spec: str) -> list[str] | None:
    """``tier_names`` resolved against the model (``listed_tier``), so an unknown tier is named before any work; a
    tier named twice (``T4,T4``, ``T10,full``) once."""
    names = tier_names(spec)
    return None if names is None else list(dict.fromkeys(model.resolve_tier(listed_tier(n)).name for n in names))


def checked_capacities(model, spec: str, flag: str = "--tiers") -> list | None:
    """``eval --tiers``: None for 'all', else a ``Tier`` per entry: a tier name or, for ESSH, a capacity fraction in
    (0, 1] through the two-rate map (Eq. 7); anything else a ``ConfigError`` naming ``flag``."""
    names, out = tier_names(spec), []
    for name in names or ():
        try:
            out.append(model.resolve_tier(listed_tier(name)))
        except ValueError as e:
            try:
                xi = float(name) if model.arch == "essh" else math.nan
            except ValueError:
                xi = math.nan
            if not 0 < xi <= 1:   # also NaN
                raise ConfigError(f"{flag} {name}: {e}; or, for an ESSH model, a capacity fraction in (0, 1] such as "
                                  "0.45") from None
            out.append(model.resolve_tier(xi))
    return None if names is None else list(dict.fromkeys(out))       # a tier given twice (T4,T4): once


def refuse_existing(args: argparse.Namespace, *paths) -> None:
    """``ConfigError`` when one of ``paths`` (``args.out`` and its companions) exists without ``--overwrite``."""
    found = [p for p in paths if p.exists()]
    if found and not args.overwrite:
        also = f" (and {', '.join(str(p) for p in found[1:])})" if len(found) > 1 else ""
        raise ConfigError(f"{spelled(args, 'out')} {found[0]} already exists{also}; pass --overwrite to replace "
                          f"{'them' if also else 'it'}, or choose another output path")


def check_replaceable(path: str, overwrite: bool, flag: str = "--csv", kind: str = "a .csv file",
                      ours: Callable[[Path], bool] = lambda p: p.suffix.lower() == ".csv") -> None:
    """``ConfigError`` for an output file ``path`` that is a folder, an existing file that is not ``ours`` (``kind``;
    even with ``overwrite``: say a model's ``config.json``), or an existing one of its kind without ``overwrite``;
    checked before any work and again by ``write_csv``."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path")
    if not os.path.lexists(p):
        return
    if not ours(p):
        raise ConfigError(f"{flag} {path} already exists and is not {kind} (say a model's config.json); it is "
                          "never replaced, even with --overwrite: choose another path")
    if not overwrite:
        raise ConfigError(f"{flag} {path} already exists; pass --overwrite to replace it, or choose another path")


def write_csv(path: str | None, rows: list[dict], overwrite: bool = False, flag: str = "--csv") -> None:
    """``rows`` (dicts of the same keys) as CSV at ``path``, atomically (None: nothing; ``check_replaceable``)."""
    if not path:
        return
    check_replaceable(path, overwrite, flag)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())     # a crash or a full disk never leaves half a table
    status(f"wrote {path}")


# ---- errors: one line, exit code 2 -----------------------------------------------------------------------
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
        message = re.sub(r"invalid literal for int\(\) with base 10: ('.*')", r"\1 is not a whole number", message)
        message = re.sub(r"could not convert string to float: ('.*')", r"\1 is not a number", message)
        text = message if event.argument is None else f"{name(event.argument)}: {message}"
        tokens = re.findall(r"'([^']*)'", message)
        values = [v for token in tokens for v in token.split(",") if v]
        if event.argument is not None and event.argument.lowered.nargs in ("*", "+") and len(values) > len(tokens):
            text += f"; give the values separated by spaces, not commas: {name(event.argument)} {' '.join(values)}"
    else:
        text = type(event).__name__
    raise CommandLineError(f"{' '.join(text.split())} (see {event.prog} --help)")


def one_line(e: BaseException) -> str:
    """The exception as one line: an ``OSError`` as ``<file>: <reason>`` (with a hint beyond a missing file or a
    denied permission), a YAML error with its line and column, ``MemoryError`` with what to make smaller."""
    named = FileNotFoundError | PermissionError | IsADirectoryError    # these name their fault: no hint
    if isinstance(e, OSError) and e.strerror and not isinstance(e, named):
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
    elif isinstance(e, RuntimeError) and (asked := re.search(r"can't allocate memory: you tried to allocate (\d+) "
                                                             r"bytes", str(e))):
        text = (f"out of memory (the CPU could not allocate {int(asked[1]):,} bytes); use a smaller model, batch or "
                "sequence length (--max_new_tokens, --seq_len, --check_len...)")
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def report(command: str, text: str, every_rank: bool = False) -> None:
    """The error line of ``elastic-ssm <command>`` on stderr: by rank 0 only, or with ``every_rank`` by each rank
    (naming it) under torchrun."""
    if every_rank and os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):   # not parsed: it may be garbage
        print(f"elastic-ssm {command} (rank {os.environ.get('RANK', '?')}): {text}", file=sys.stderr)
    elif is_rank_zero():
        print(f"{f'elastic-ssm {command}'.strip()}: {text}", file=sys.stderr)


def stdout_gone() -> bool:
    """Whether stdout's reader has gone (``elastic-ssm ... | head``: the pipe's write end reports POLLERR). If so,
    stdout now points at /dev/null, so that the exit's flush raises nothing, and the caller stops quietly with 141
    (128 + SIGPIPE), as a Unix tool does."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):     # no poll (Windows), or stdout is no file
        return False
    return True


def run_reporting_errors(fn: Callable[[], Any], command: str, debug: bool) -> int:
    """``fn()``'s exit code, errors reported as the module docstring says; ``debug``: ``--debug`` was given (the
    ``ELASTIC_SSM_DEBUG`` switch, ``utils.environment.env_flag``, turns it on too; garbage there is one line, exit
    code 2). Without it a warning is one line too (no source line)."""
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
        if isinstance(e, BrokenPipeError) and stdout_gone():
            return 141
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
    ``elastic-ssm``: the helper processes' entry (``elastic_ssm.bench.serve``, ``benchmarks.first_token``...)."""
    import tyro
    from tyro._errors import on_parse_error

    try:
        with on_parse_error(parse_error):
            return tyro.cli(cls, args=argv, prog=prog, description=description, use_underscores=True)
    except CommandLineError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
