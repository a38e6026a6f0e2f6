"""``select_tier``: the best tier within latency, state and parameter budgets (docs/serving.md)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StringConstraints, TypeAdapter, ValidationError

from ..elastic.tiers import Tier, check_counts, state_bytes, tier_table

__all__ = ["select_tier", "tier_choice", "TierChoice", "PROFILE_FILE", "QUALITY_FILE", "profile_ms"]

PROFILE_FILE = "tier_profile.json"
QUALITY_FILE = "tier_quality.json"
#: a profile row's ``ms_per_token`` table: batch sizes (decimal digits) -> milliseconds >= 0
_MS_TABLE = TypeAdapter(dict[Annotated[str, StringConstraints(pattern=r"^[0-9]+$")],
                             Annotated[float, Field(ge=0, strict=True)]])


def _read(path: Path | None, name: str) -> dict | None:
    if path is None or not (path / name).is_file():
        return None
    try:
        data = json.loads((path / name).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / name} is not valid JSON ({e}); measure it again") from e
    if not isinstance(data, dict) or not isinstance(data.get("tiers"), dict):
        raise ValueError(f"{path / name} has no 'tiers' table; measure it again")
    for tier, row in data["tiers"].items() if name == PROFILE_FILE else ():   # profile_ms reads every row
        table = row.get("ms_per_token") if isinstance(row, dict) else row
        try:
            _MS_TABLE.validate_python(table)
        except ValidationError:
            raise ValueError(f"{path / name}: tier {tier!r} has no ms_per_token table (batch size -> ms >= 0), got "
                             f"{json.dumps(table)[:80]}; measure it again: elastic-ssm calibrate {path} --tiers {tier}"
                             ) from None
    return data


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


def _span(names: list[str], order: list[str]) -> str:
    """Tier names with runs of neighbours in the tier table written ``T5-T10``."""
    idx = enumerate(sorted(order.index(n) for n in names))
    runs = [[i for _, i in run] for _, run in itertools.groupby(idx, lambda k_i: k_i[1] - k_i[0])]
    return ",".join(order[r[0]] if len(r) == 1 else f"{order[r[0]]}{'-' if len(r) > 2 else ','}{order[r[-1]]}"
                    for r in runs)


@dataclass
class TierChoice:
    """What ``tier_choice`` picked and from what."""

    tier: Tier
    considered: list[str]                  # the tiers within every budget, smallest first
    unmeasured: list[str] = field(default_factory=list)   # left out: no timing at a batch >= ``batch``
    by: str = "tier order"                 # "tier order" or the quality metric that decided
    unscored: list[str] = field(default_factory=list)     # considered tiers tier_quality.json does not score
    order: list[str] = field(default_factory=list)        # the tier table's names
    batch: int = 1
    path: Path | None = None

    def line(self) -> str:
        """One sentence: the tier, how it was chosen, from which tiers, and which were never measured."""
        span = lambda names: _span(names, self.order or names)
        how = f"best {self.by} in {QUALITY_FILE}" if self.by != "tier order" else "largest by tier order"
        if self.unscored:
            how += f" ({QUALITY_FILE} does not score {span(self.unscored)})"
        text = (f"{self.tier.name} ({self.tier.params:,} parameters) fits the budget: {how} of the tiers "
                f"considered, {span(self.considered)}")
        if self.unmeasured:
            larger = [n for n in self.unmeasured if self.order.index(n) > self.order.index(self.tier.name)]
            text += (f"; not considered, never timed at batch >= {self.batch} in {PROFILE_FILE}: "
                     f"{span(self.unmeasured)}" + (" (a larger tier may fit too)" if larger else "")
                     + f"; time them: elastic-ssm calibrate {self.path or 'DIR'} --tiers {','.join(self.unmeasured)}"
                     f" --batches {self.batch}")
        return text


def select_tier(model_or_dir: Any, max_ms_per_token: float | None = None, max_state_bytes: int | None = None,
                max_params: int | None = None, batch: int = 1, *, profile: dict | None = None,
                quality: dict | None = None) -> Tier:
    """The best tier within every budget: parameters and state bytes of ``batch`` sequences from the config, latency
    from ``tier_profile.json`` at the smallest profiled batch >= ``batch`` (never timed there: no fit);
    ``tier_quality.json`` decides when it scores every fitting tier, else the largest wins (``profile`` /
    ``quality``: tables used instead of the files). ``ValueError`` naming the closest tier when none fits."""
    return tier_choice(model_or_dir, max_ms_per_token, max_state_bytes, max_params, batch, profile=profile,
                       quality=quality).tier


def tier_choice(model_or_dir: Any, max_ms_per_token: float | None = None, max_state_bytes: int | None = None,
                max_params: int | None = None, batch: int = 1, *, profile: dict | None = None,
                quality: dict | None = None) -> TierChoice:
    """``select_tier``'s choice with what it was made from (``TierChoice``; ``.line()`` says it)."""
    check_counts(batch=batch)
    for name, v in (("max_ms_per_token", max_ms_per_token), ("max_state_bytes", max_state_bytes),
                    ("max_params", max_params)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):   # NaN too
            raise ValueError(f"{name} must be a positive number (inf: no limit), got {v!r}")
    cfg, path = _config_and_dir(model_or_dir)
    profile = profile if profile is not None else _read(path, PROFILE_FILE)
    quality = quality if quality is not None else _read(path, QUALITY_FILE)
    table = tier_table(cfg)
    if max_ms_per_token is not None and profile is None:
        if cfg.arch != "essh":        # calibrate times the fused ESSH decoder only: no profile can exist
            raise ValueError(f"a latency budget needs a profile that `elastic-ssm calibrate` measures for ESSH models "
                             f"only, and this is a model of arch {cfg.arch!r}; choose by --max_params or "
                             f"--max_state_bytes instead; the smallest tier is {table[0].name}")
        raise ValueError(f"a latency budget needs a measured profile: run `elastic-ssm calibrate {path or 'DIR'}` "
                         f"(no {PROFILE_FILE} found); the smallest tier is {table[0].name}")
    misses: dict[str, list[str]] = {}
    fits: list[Tier] = []
    unmeasured: list[str] = []
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
                unmeasured.append(t.name)
            elif ms > max_ms_per_token:
                why.append(f"{ms:.3f} ms/token at batch {batch} > {max_ms_per_token:g}")
        (misses.__setitem__(t.name, why) if why else fits.append(t))
    if not fits:
        closest = min(table, key=lambda t: (len(misses[t.name]), t.index))
        raise ValueError(f"no tier fits the budget; the closest is {closest.name} ({'; '.join(misses[closest.name])})")
    scores = {k: v.get("value") if isinstance(v, dict) else v for k, v in ((quality or {}).get("tiers") or {}).items()}
    unscored = [t.name for t in fits if not isinstance(scores.get(t.name), (int, float))]
    choice = TierChoice(max(fits, key=lambda t: t.index), [t.name for t in fits],
                        [n for n in unmeasured if len(misses[n]) == 1], unscored=unscored if quality else [],
                        order=[t.name for t in table], batch=batch, path=path)
    if quality and not unscored:
        sign = 1.0 if quality.get("higher_is_better", False) else -1.0
        choice.tier = max(fits, key=lambda t: (sign * float(scores[t.name]), t.index))
        choice.by = str(quality.get("metric") or "quality")
    return choice
