"""What a measured number depends on, ``environment(device)``: device, torch / CUDA / triton / fla versions
(``library_versions``: None when absent, the import error when broken), scan backend, commit, date: the record of
every benchmark row, replication call and ``tier_profile.json``. ``env_int`` / ``env_flag`` read the library's
environment variables, a one-line ``ConfigError`` naming a bad one; torch loads only where a number is measured."""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["env_flag", "env_int", "environment", "library_versions"]

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_int(name: str, default: int) -> int:
    """``int(os.environ[name])``, ``default`` when unset or empty; a ``ConfigError`` naming ``name`` otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={raw!r} is not an integer; unset it, or launch "
                          f"through torchrun, which sets it") from None


def env_flag(name: str) -> bool:
    """Whether the switch ``name`` is on (``_ON``) or off (``_OFF``: unset too); a ``ConfigError`` otherwise."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ConfigError(f"the environment variable {name}={os.environ[name]!r} is not a switch; set it to 1 (on) or "
                      f"0 (off), or unset it")


def library_versions(mods: tuple[str, ...] = ("fla", "mamba_ssm", "triton")) -> dict[str, str | None]:
    """Installed versions of ``mods`` (default: the optional libraries the fast paths and the peers use; None when
    absent)."""
    out: dict[str, str | None] = {}
    for mod in mods:
        if importlib.util.find_spec(mod) is None:
            out[mod] = None
            continue
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "unknown")
        except Exception as e:  # an installed but broken package is reported, not fatal
            out[mod] = f"import failed: {type(e).__name__}: {e}"
    return out


def _git_commit() -> str:
    """``ELASTIC_SSM_COMMIT`` if set, else the checkout's short HEAD with ``-dirty`` when tracked files differ
    from it (a copied working tree, e.g. on a lent GPU machine, can carry a stale ``.git``)."""
    if os.environ.get("ELASTIC_SSM_COMMIT"):
        return os.environ["ELASTIC_SSM_COMMIT"]
    try:
        root = str(Path(__file__).resolve().parents[2])
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "-C", root, "diff-index", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=30).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _scan_backend(device: torch.device) -> str:
    """The spectral-scan backend ``"auto"`` resolves to for this device (``ELASTIC_SSM_SCAN_BACKEND`` applied):
    the fla and torch scans differ in speed and in first-use autotuning, so a benchmark row names it."""
    import torch

    from ..ops.dispatch import resolve_backend

    try:
        return resolve_backend("auto", torch.empty(0, device=device))
    except (ValueError, ImportError) as e:
        return f"unusable ({e})"


def environment(device: torch.device, command: str | None = None) -> dict:
    import torch

    libs = library_versions()
    return {
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or "cpu"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": libs["triton"], "fla": libs["fla"],
        "mamba_ssm": libs["mamba_ssm"], "scan_backend": _scan_backend(device), "python": platform.python_version(),
        "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command if command is not None else " ".join(sys.argv),
    }
