"""The machine a run is on. ``checked_device``: the one check of a device a user names (``--device``,
``from_pretrained(device=)``), ``auto_device`` (never mps, which has no float64) and the CPU threads torch runs with
(``apply_default_threads``). What a measured number depends on, ``environment(device)``: device, torch / CUDA /
triton / fla versions (``library_versions``: None when absent, the import error when broken), scan backend, commit,
date: the record of every benchmark row, replication call and ``tier_profile.json``. ``env_int`` / ``env_flag`` read
the library's environment variables, a one-line ``ConfigError`` naming a bad one. torch loads only where it is used."""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["env_flag", "env_int", "environment", "library_versions", "auto_device", "available_cores",
           "apply_default_threads", "checked_device", "cpu_threads_for", "DEVICE_CHOICES", "MPS_NO_FLOAT64"]

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


# ---- devices and CPU threads ------------------------------------------------------------------------------
DEVICE_CHOICES = "cpu, cuda or cuda:N"
#: why mps is never used: what would not run there
MPS_NO_FLOAT64 = ("Apple's MPS backend has no float64, which the spectral layers need (the damped-rotation phases, "
                  "ESSH Eq. 5, and the Hankel filters are float64)")


def auto_device() -> tuple[str, str | None]:
    """What ``auto`` means on this machine: ``("cuda", None)`` when CUDA is available, else ``("cpu", note)`` where
    ``note`` is one line saying why not mps when this machine has MPS (None when it has not)."""
    import torch

    if torch.cuda.is_available():
        return "cuda", None
    return "cpu", (f"device auto: cpu, not mps ({MPS_NO_FLOAT64})" if torch.backends.mps.is_available() else None)


def checked_device(spec: str | torch.device, what: str = "device") -> torch.device:
    """``spec`` as a ``torch.device`` on this machine, else a ``ConfigError`` naming the setting ``what``."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{what} {str(spec)!r} is not a device; use {DEVICE_CHOICES}") from None
    if dev.type == "mps":
        raise ConfigError(f"{what} {str(spec)!r}: {MPS_NO_FLOAT64}; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} {str(spec)!r}: only cpu and cuda are supported; use {DEVICE_CHOICES}")
    if dev.type == "cpu" and dev.index is not None:     # safetensors cannot load onto cpu:N (blamed the file)
        raise ConfigError(f"{what} {str(spec)!r}: the CPU is one device without an index; use cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} {str(spec)!r}: CUDA is not available on this machine; use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ConfigError(f"{what} {str(spec)!r}: this machine has {count} CUDA device(s) (cuda:0 .. "
                             f"cuda:{count - 1}); pick one of them")
    return dev


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(cpu_max: Path = CGROUP_CPU_MAX) -> tuple[int, str]:
    """The cores this process may use and where that number comes from: the affinity mask (Linux), narrowed by a
    cgroup v2 quota (``cpu.max``: quota and period in microseconds) when one is set."""
    try:
        cores, why = len(os.sched_getaffinity(0)), "affinity"
    except AttributeError:                       # macOS, Windows: no affinity call
        cores, why = os.cpu_count() or 1, "cpu_count"
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            limit = max(1, math.ceil(int(quota) / int(period)))
            if limit < cores:
                cores, why = limit, "cgroup quota"
    except (OSError, ValueError):
        pass
    return max(1, cores), why


def apply_default_threads() -> str:
    """Set torch's intra-op threads to ``available_cores()`` unless ``OMP_NUM_THREADS`` is set; returns the line
    that says what runs (for the run's first status line)."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return f"cpu threads: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cores, why = available_cores()
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return f"cpu threads: {cores} (the cores this process may use, by {why}; OMP_NUM_THREADS sets another number)"


def cpu_threads_for(device: str) -> str | None:
    """``apply_default_threads()`` when ``device`` (a run's ``train.device``) trains on the CPU, else None; for
    ``auto`` on a machine with MPS and no CUDA the line also says why not mps (``auto_device``)."""
    if device == "cpu":
        return apply_default_threads()
    if device == "auto":
        picked, note = auto_device()
        if picked == "cpu":
            return apply_default_threads() + (f"; {note}" if note else "")
    return None
