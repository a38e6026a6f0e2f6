"""Targets of a bench suite as data: ``{METRIC: {max|min|equals: X}}`` on an entry's rows, narrowed by
``where: {column: value}`` and named by ``name``; PASS / FAIL per row, or one ``n/a`` saying why no row answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_ssm.config import ConfigError

__all__ = ["Target", "parse_targets", "evaluate_targets"]

_BOUNDS = ("max", "min", "equals")


@dataclass(kw_only=True)
class Target:
    """One bound set on one metric (a row column) of an entry's rows."""

    metric: str
    max: float | None = None
    min: float | None = None
    equals: Any = None
    where: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        """``name`` if given, else e.g. ``ms_per_token <= 0.6 (tier=T10, batch=1)``."""
        if self.name:
            return self.name
        parts = [f"{self.metric} <= {self.max:g}" if self.max is not None else "",
                 f"{self.metric} >= {self.min:g}" if self.min is not None else "",
                 f"{self.metric} == {self.equals!r}" if self.equals is not None else ""]
        where = ", ".join(f"{k}={v}" for k, v in self.where.items())
        return " and ".join(p for p in parts if p) + (f" ({where})" if where else "")

    def matches(self, row: dict) -> bool:
        return all(_same(row.get(k), v) for k, v in self.where.items())

    def holds(self, value: Any) -> bool:
        if self.equals is not None and not _same(value, self.equals):
            return False
        if self.max is not None and not (_number(value) and value <= self.max):
            return False
        return not (self.min is not None and not (_number(value) and value >= self.min))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
    """Row value == YAML value, with numbers compared as numbers and anything else as text."""
    if _number(a) and _number(b):
        return float(a) == float(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or str(a).lower() == str(b).lower()
    return str(a) == str(b)


_KEYS = ("model", "preset", "tier", "batch", "mode", "length", "name", "probe", "run", "backend", "mix", "step",
         "product", "label")


def _describe(row: dict, where: dict) -> str:
    """The row's identifying columns that ``where`` did not already fix, e.g. ``tier=T3 batch=1``."""
    return " ".join(f"{k}={row[k]}" for k in _KEYS if k in row and k not in where)[:60]


def parse_targets(spec: Any, where: str) -> list[Target]:
    """Targets of one entry from its ``target`` (a mapping) or ``targets`` (a list of mappings) value;
    ``where`` names the entry in errors."""
    items = spec if isinstance(spec, list) else [spec]
    out: list[Target] = []
    for item in items:
        if not isinstance(item, dict) or not item:
            raise ConfigError(f"{where}: a target is a mapping such as {{ms_per_token: {{max: 1.25}}}}, got {item!r}")
        item = dict(item)
        sel, name = item.pop("where", {}) or {}, item.pop("name", "")
        if not isinstance(sel, dict):
            raise ConfigError(f"{where}: a target's 'where' must map row columns to values, got {sel!r}")
        if not item:
            raise ConfigError(f"{where}: target {name or sel!r} names no metric; add e.g. ms: {{max: 1.2}}")
        for metric, bounds in item.items():
            if not isinstance(bounds, dict) or not bounds or set(bounds) - set(_BOUNDS):
                raise ConfigError(f"{where}: target metric {metric!r} needs a mapping of {'/'.join(_BOUNDS)}, "
                                  f"e.g. {metric}: {{max: 1.25}}; got {bounds!r}")
            for b in ("max", "min"):
                if b in bounds and not _number(bounds[b]):
                    raise ConfigError(f"{where}: target {metric}.{b} must be a number, got {bounds[b]!r}")
            out.append(Target(metric=str(metric), where=sel, name=str(name), **bounds))
    return out


def evaluate_targets(targets: list[Target], rows: list[dict], entry: str, state: str = "ran") -> list[dict]:
    """Results ``{"entry", "target", "value", "status", ...}`` of ``targets`` over the entry's ``rows``;
    ``state`` is the entry's outcome (``ran``, ``skipped: ...``, ``error: ...``), the reason of an n/a.
    Every row a target judged gets ``row["target"]`` = PASS, or FAIL when any target failed on it."""
    out = []
    for t in targets:
        judged = [r for r in rows if t.matches(r) and t.metric in r and r[t.metric] is not None]
        if not judged:
            errors = [r["error"] for r in rows if t.matches(r) and r.get("error")]
            why = state if state != "ran" else (f"row error: {errors[0]}" if errors else "no matching row")
            out.append({"entry": entry, "target": t.label, "value": None, "status": "n/a", "why": why})
            continue
        for r in judged:
            ok = t.holds(r[t.metric])
            r["target"] = "FAIL" if r.get("target") == "FAIL" or not ok else "PASS"
            out.append({"entry": entry, "target": t.label, "row": _describe(r, t.where), "value": r[t.metric],
                        "status": "PASS" if ok else "FAIL"})
    return out
