"""What a measured number depends on: device, torch / CUDA / triton / fla versions, scan backend, commit, date.

``environment(device)`` is the record every benchmark row, replication call and ``tier_profile.json`` carries;
``library_versions`` the optional libraries' versions (None when absent, the import error when broken).
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["environment", "library_versions"]


def library_versions() -> dict[str, str | None]:
    """Installed versions of the optional libraries the fast paths and the peers use (None when absent)."""
    out: dict[str, str | None] = {}
    for mod in ("fla", "mamba_ssm", "triton"):
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
    from ..ops.dispatch import resolve_backend

    try:
        return resolve_backend("auto", torch.empty(0, device=device))
    except (ValueError, ImportError) as e:
        return f"unusable ({e})"


def environment(device: torch.device, command: str | None = None) -> dict:
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
