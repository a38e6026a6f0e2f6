"""Environment variables the library reads, parsed with a one-line ``ConfigError`` naming the variable:
``env_int`` (an integer) and ``env_flag`` (1 / true / yes / on, or unset / empty / 0 / false / no / off).
"""

from __future__ import annotations

import os

from ..config import ConfigError

__all__ = ["env_int", "env_flag"]

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
    """Whether the switch ``name`` is on (see the module docstring); a ``ConfigError`` for any other value."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ConfigError(f"the environment variable {name}={os.environ[name]!r} is not a switch; set it to 1 (on) or "
                      f"0 (off), or unset it")
