"""Tier choice under a budget: ``select_tier`` over exact counts, a measured profile and measured quality.

A model directory may hold two measurement files beside ``config.json``:

* ``tier_profile.json`` (``elastic-ssm calibrate``, ``serve/calibrate.py``): the device and versions it was
  measured on, and per tier ``ms_per_token`` by decode batch (the served path's decode step: every stream
  of a batch gets one token per step), ``state_bytes`` (per sequence) and ``params``;
* ``tier_quality.json`` (``elastic-ssm eval``): ``data``, ``metric``, ``higher_is_better`` and per tier the
  ``value`` measured.

``select_tier(model_or_dir, max_ms_per_token=None, max_state_bytes=None, max_params=None, batch=1)`` returns
the ``Tier`` of best quality among those within every given budget: parameters of the standalone export
and persistent state for ``batch`` sequences (fp32 recurrent state, bf16 window ring: ``elastic.tiers``)
come exactly from the config; latency from the profile at the smallest profiled batch >= ``batch``. Without
``tier_quality.json`` the best is the largest tier that fits (the tier order makes it the best by
construction). No tier fitting, or a latency budget without a profile, is a ``ValueError`` naming the
closest tier and what it would need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..elastic.tiers import Tier, state_bytes, tier_table

__all__ = ["select_tier", "read_profile", "read_quality", "PROFILE_FILE", "QUALITY_FILE", "profile_ms"]

PROFILE_FILE = "tier_profile.json"
QUALITY_FILE = "tier_quality.json"


def _read(path: Path | None, name: str) -> dict | None:
    if path is None or not (path / name).is_file():
        return None
    try:
        data = json.loads((path / name).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / name} is not valid JSON ({e}); measure it again") from e
    if not isinstance(data, dict) or not isinstance(data.get("tiers"), dict):
        raise ValueError(f"{path / name} has no 'tiers' table; measure it again")
    return data


def read_profile(path: str | Path) -> dict | None:
    """The ``tier_profile.json`` of a model directory (None when absent)."""
    return _read(Path(path), PROFILE_FILE)


def read_quality(path: str | Path) -> dict | None:
    """The ``tier_quality.json`` of a model directory (None when absent)."""
    return _read(Path(path), QUALITY_FILE)


def profile_ms(profile: dict, tier: str, batch: int) -> float | None:
    """ms/token of ``tier`` at the smallest profiled batch >= ``batch`` (None: not profiled that far)."""
    table = (profile["tiers"].get(tier) or {}).get("ms_per_token") or {}
    fits = sorted(int(b) for b in table if int(b) >= batch)
    return float(table[str(fits[0])]) if fits else None


def _config_and_dir(model_or_dir: Any):
    if isinstance(model_or_dir, (str, Path)):
        from ..models import saved_model_class

        path = Path(model_or_dir)
        return saved_model_class(path).read_config(path)[0], path
    cfg = getattr(model_or_dir, "config", None)
    if cfg is None:
        raise TypeError(f"select_tier needs a model or a model directory, got {type(model_or_dir).__name__}")
    source = getattr(model_or_dir, "name_or_path", None)
    # a model loaded at one tier of a larger checkpoint: its measurement files describe the parent's tiers
    return cfg, Path(source) if source and not (getattr(model_or_dir, "source", None) or {}).get("tier") else None


def select_tier(model_or_dir: Any, max_ms_per_token: float | None = None, max_state_bytes: int | None = None,
                max_params: int | None = None, batch: int = 1, *, profile: dict | None = None,
                quality: dict | None = None) -> Tier:
    """The best-quality tier within every given budget (see the module docstring). ``profile`` / ``quality``:
    tables in the files' format, used instead of the directory's files."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    for name, v in (("max_ms_per_token", max_ms_per_token), ("max_state_bytes", max_state_bytes),
                    ("max_params", max_params)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):   # NaN too
            raise ValueError(f"{name} must be a positive number (inf: no limit), got {v!r}")
    cfg, path = _config_and_dir(model_or_dir)
    profile = profile if profile is not None else _read(path, PROFILE_FILE)
    quality = quality if quality is not None else _read(path, QUALITY_FILE)
    table = tier_table(cfg)
    if max_ms_per_token is not None and profile is None:
        raise ValueError(f"a latency budget needs a measured profile: run `elastic-ssm calibrate {path or 'DIR'}` "
                         f"(no {PROFILE_FILE} found); the smallest tier is {table[0].name}")
    misses: dict[str, list[str]] = {}
    fits: list[Tier] = []
    for t in table:
        why = []
        if max_params is not None and t.params > max_params:
            why.append(f"params {t.params:,} > {max_params:,}")
        sb = state_bytes(cfg, t, batch)["total"]
        if max_state_bytes is not None and sb > max_state_bytes:
            why.append(f"state {sb:,} B at batch {batch} > {int(max_state_bytes):,}")
        if max_ms_per_token is not None:
            ms = profile_ms(profile, t.name, batch)
            if ms is None:
                why.append(f"not profiled at batch >= {batch}")
            elif ms > max_ms_per_token:
                why.append(f"{ms:.3f} ms/token at batch {batch} > {max_ms_per_token:g}")
        (misses.__setitem__(t.name, why) if why else fits.append(t))
    if not fits:
        closest = min(table, key=lambda t: (len(misses[t.name]), t.index))
        raise ValueError(f"no tier fits the budget; the closest is {closest.name} ({'; '.join(misses[closest.name])})")
    scores = {k: v["value"] if isinstance(v, dict) else v for k, v in ((quality or {}).get("tiers") or {}).items()}
    if quality and all(isinstance(scores.get(t.name), (int, float)) for t in fits):
        sign = 1.0 if quality.get("higher_is_better", False) else -1.0
        return max(fits, key=lambda t: (sign * float(scores[t.name]), t.index))
    return max(fits, key=lambda t: t.index)
