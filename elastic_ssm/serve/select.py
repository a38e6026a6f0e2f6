"""``select_tier``: the best tier within latency, state and parameter budgets (docs/serving.md).

The records ``select_tier`` reads, ``tier_profile.json`` (ms/token per tier and batch) and ``tier_quality.json``
(``eval``), written atomically, merged into a comparable saved record or renamed aside (docs/serving.md)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field, StringConstraints, TypeAdapter, ValidationError

from ..elastic.tiers import Tier, check_counts, state_bytes, tier_table
from ..utils.files import atomic_write_bytes, free_stamped_path, read_json

__all__ = ["select_tier", "tier_choice", "TierChoice", "PROFILE_FILE", "QUALITY_FILE", "profile_ms", "calibrate",
           "write_profile", "write_quality", "quality_table", "PROFILE_KEYS", "QUALITY_KEYS"]

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


# the settings that make two records' numbers comparable (a merge needs them equal)
PROFILE_KEYS = ("device", "dtype", "torch", "triton", "cuda")
QUALITY_KEYS = ("metric", "data", "split", "seq_len", "window", "batch_size", "n_batches", "tokenizer",
                "bytes_per_token", "device", "dtype")


def _step_ms(pool, warmup: int, iters: int) -> float:
    tokens = torch.zeros(pool.slots, dtype=torch.long, device=pool.device)
    for _ in range(warmup):
        pool.step(tokens)
    if pool.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(pool.device)
        start.record()
        for _ in range(iters):
            pool.step(tokens)
        end.record()
        torch.cuda.synchronize(pool.device)
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        pool.step(tokens)
    return (time.perf_counter() - t) * 1e3 / iters


def calibrate(model, batches: list[int], tiers: list[str] | None = None, warmup: int = 5, iters: int = 20,
              progress=print, show_progress: bool = False) -> dict:
    """``tier_profile.json``'s table: ms per served decode step of each tier in a ``SlotPool`` of each batch, reading
    the whole window ring (the long-context bound); ``progress``: a line per entry, ``show_progress``: a bar."""
    from ..utils.environment import environment
    from ..utils.progress import progress as progress_bar
    from .slots import SlotPool

    device = model.embed.weight.device
    names = tiers or [t.name for t in model.tier_table()]
    env = environment(device, command=None)
    out = {"device": env["device"], "torch": env["torch"], "triton": env["triton"], "cuda": env["cuda"],
           "dtype": str(model.embed.weight.dtype).replace("torch.", ""), "commit": env["commit"],
           "date": env["date"], "warmup": warmup, "iters": iters, "tiers": {}}
    bar = progress_bar(desc="calibrate", total=len(names) * len(batches), enabled=show_progress, unit="entry")
    for name in names:
        t = model.resolve_tier(name)
        row = {"ms_per_token": {}, "state_bytes": state_bytes(model.config, t)["total"], "params": t.params}
        for b in batches:
            pool = SlotPool(model, t, b, spans=False)     # the whole ring every step: the long-context cost
            row["ms_per_token"][str(b)] = round(_step_ms(pool, warmup, iters), 5)
            del pool
            bar.update()
            progress(f"  {name} batch {b}: {row['ms_per_token'][str(b)]:.3f} ms/token")
        row["date"] = out["date"]
        out["tiers"][name] = row
    bar.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _tier_names(names) -> str:
    names = sorted(names, key=lambda n: (len(n), n))      # T2 before T10
    if len(names) > 4:
        return f"{names[0]}..{names[-1]}, {len(names)} tiers"
    return ",".join(names) if names else "no tiers"


def _not_comparable(old, new: dict, keys: tuple[str, ...]) -> str | None:
    """Why the saved record ``old`` cannot be merged with ``new`` (None: it can)."""
    if not isinstance(old, dict) or not isinstance(old.get("tiers"), dict):
        return "it is not a readable record"
    absent = [k for k in keys if k not in old and new.get(k) is not None]
    diffs = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if k not in absent and old.get(k) != new.get(k)]
    if absent:
        diffs.append(f"it does not record {', '.join(absent)}")
    for tier, row in new["tiers"].items():
        was = old["tiers"].get(tier)
        if isinstance(was, dict) and isinstance(row, dict) and was.get("params") != row.get("params"):
            diffs.append(f"{tier} params {was.get('params')} -> {row.get('params')} (another model)")
            break
    return "; ".join(diffs) or None


def _merge_write(path: str | Path, name: str, table: dict, keys: tuple[str, ...], merge_rows: Callable,
                 notice: Callable[[str], None] | None) -> Path:
    """Write ``table`` as ``path/name``, merged into the saved record when comparable, else beside it."""
    target = Path(path) / name
    if target.is_file():
        old = read_json(target)
        why = _not_comparable(old, table, keys)
        if why is None:
            tiers = dict(old["tiers"])
            for tier, row in table["tiers"].items():
                tiers[tier] = merge_rows(tiers.get(tier), row)
            table = {**table, "tiers": tiers}
        else:
            dest = free_stamped_path(target.parent, f"{target.stem}.replaced-", ".json")
            os.replace(target, dest)
            saved = old.get("tiers") if isinstance(old, dict) else None
            saved = [str(t) for t in saved] if isinstance(saved, dict) else []
            (notice or functools.partial(print, file=sys.stderr))(
                f"{target}: the saved record ({_tier_names(saved)}) is not comparable with this one ({why}); kept it "
                f"as {dest.name}, and {name} now holds {_tier_names(list(table['tiers']))} only")
    atomic_write_bytes(target, (json.dumps(table, indent=1) + "\n").encode())
    return target


def _merge_profile_row(old, new: dict) -> dict:
    if not isinstance(old, dict) or not isinstance(old.get("ms_per_token"), dict):
        return new
    return {**old, **new, "ms_per_token": {**old["ms_per_token"], **new["ms_per_token"]}}


def write_profile(path: str | Path, profile: dict, notice: Callable[[str], None] | None = None) -> Path:
    """Write ``tier_profile.json`` into the model directory ``path`` (``notice``: stderr)."""
    return _merge_write(path, PROFILE_FILE, profile, PROFILE_KEYS, _merge_profile_row, notice)


def quality_table(rows, data: str, split: str, metric: str = "bpb", **settings) -> dict:
    """``tier_quality.json``'s table from ``evaluate_tiers`` rows (``metric``: one of ``eval --quality_metric``'s
    choices; higher is better for ``accuracy`` only); ``settings``: the ``QUALITY_KEYS`` the rows do not give."""
    unknown = set(settings) - set(QUALITY_KEYS)
    if unknown:
        raise ValueError(f"unknown quality settings {sorted(unknown)}; known: {', '.join(QUALITY_KEYS)}")
    rows, tiers = list(rows), {}
    for r in rows:
        d = r.row()
        tiers[d["tier"]] = {"value": d[metric], "loss": d["loss"], "tokens": d["tokens"], "params": d["params"]}
    def same(field: str):     # the rows' common value (None when they differ)
        values = {getattr(r, field) for r in rows}
        return values.pop() if len(values) == 1 else None

    return {"data": data, "split": split, "metric": metric, "higher_is_better": metric == "accuracy",
            "seq_len": same("seq_len"), "bytes_per_token": same("bytes_per_token"), **settings, "tiers": tiers}


def write_quality(path: str | Path, table: dict, notice: Callable[[str], None] | None = None) -> Path:
    """Write ``tier_quality.json`` into the model directory ``path`` (``notice``: stderr)."""
    return _merge_write(path, QUALITY_FILE, table, QUALITY_KEYS, lambda old, new: new, notice)
