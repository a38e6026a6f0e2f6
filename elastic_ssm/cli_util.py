"""What the verbs share once their options are parsed: rank-0 status lines, ``--device`` / ``--dtype`` resolution,
tier lists (``--tiers T1,T4``), output-path checks and atomic CSV writing, and the flag of an option as the user
typed it (``spelled``) and the run-section flags given (``overrides``). Torch is imported only by the functions
that need it."""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Any

from .config import ConfigError, tier_word


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
    """The flag of option ``name`` as the user wrote it (``--seq_len``, an older alias such as ``--pairs``), else
    its own spelling (``--seq_len``); a positional argument by its ``--help`` name (``SOURCE``, ``MODEL_DIR``)."""
    typed = getattr(args, "_spelled", {})
    return typed.get(name) or "--" + name


def overrides(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The ``--<section>.<field>`` flags given on the command line, as field path -> parsed value (a nested
    section's field as ``optim.lr``: ``ConfigBase.updated`` applies it); the flags not given are left to the run
    file."""
    out = {}
    for path in sorted(getattr(args, "_given", ())):
        head, _, rest = path.partition(".")
        if head != section or not rest:
            continue
        value = getattr(args, section)
        for part in rest.split("."):
            value = getattr(value, part)
        out[rest] = value
    return out


def is_rank_zero() -> bool:
    """Whether this process prints status lines: rank 0 of a torchrun / ``torch.distributed`` job (``RANK``,
    or the initialised process group), or a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


# ---- the device of the evaluating / generating verbs ----------------------------------------------------
DEVICE_HELP = "auto (cuda when a GPU is present, else cpu; never mps, which has no float64), cpu, cuda or cuda:N"


def resolve_device(spec: str) -> str:
    """``--device`` -> a torch device string; a one-line ConfigError for a device this machine lacks. ``auto`` on a
    machine with MPS and no CUDA says on stderr why it runs on the CPU."""
    from .utils.devices import auto_device, checked_device

    if spec == "auto":
        device, note = auto_device()
        if note and is_rank_zero():
            print(note, file=sys.stderr)
        return device
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
