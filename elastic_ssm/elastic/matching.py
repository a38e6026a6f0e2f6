"""Parameter matching of the baselines, reported with every run (ESSH Appendix E.6, Tables 8, 9, 39, 54; the rules
are ``RULES``; a mixer-only ESSH, Tables 21-23, is reported, not matched). ``elastic-ssm train`` prints
``format_report`` before the first step and writes ``<out_dir>/parameters.json``."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ESSHConfig, model_config_from_dict, tier_word
from . import tiers as tiers_mod

__all__ = ["PAPER_PARAMS_M", "parameter_report", "format_report"]

#: Full-model parameter counts in millions as the paper reports them: (arch, preset) -> (count, source).
PAPER_PARAMS_M: dict[tuple[str, str], tuple[float, str]] = {
    ("essh", "370m"): (370.9, "Table 9"),
    ("transformer", "370m"): (365.6, "Table 9"),
    ("matformer", "370m"): (365.6, "Tables 9, 39"),
    ("essh", "1.5b"): (1531.1, "Table 54"),
    ("transformer", "1.5b"): (1536.3, "Table 54"),
}
#: The matching tolerance of each arch against the ESSH reference (Table 8; Table 54 for 1.5B is tighter).
RULES = {"transformer": (0.02, "Table 8: same depth, data, tokens, schedule; parameters within 2% (width: Table 9)"),
         "matformer": (0.02, "Table 8: the Transformer++ backbone with nested FFN widths"),
         "specialist": (0.0, "Table 43: exactly the tier's export shape, trained from scratch")}


def _reference(source: dict[str, Any]) -> tuple[str, int] | None:
    """(description, parameter count) of what a run is matched to, from its ``model`` section."""
    arch, preset, tier = source.get("arch", "essh"), source.get("preset"), source.get("tier_config")
    if tier:
        parent = model_config_from_dict({k: v for k, v in source.items() if k != "tier_config"})
        t = tiers_mod.resolve_tier(parent, tier_word(tier))
        return f"{t.name} of {arch} {preset or '(fields)'}", t.params
    if arch == "essh" and preset and preset.endswith("-mixer"):     # Tables 21-23: reported, not matched
        return f"essh {preset[:-6]} (hybrid)", tiers_mod.num_parameters(ESSHConfig.preset(preset[:-6]))
    if arch in ("transformer", "matformer") and preset:
        try:
            return f"essh {preset}", tiers_mod.num_parameters(ESSHConfig.preset(preset))
        except ConfigError:
            return None
    return None


def parameter_report(cfg: Any, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameter counts of a run's model ``cfg`` (``params``, ``tiers``) and, when known, its ``reference``
    (the model matched to: ``params``, relative ``gap``, ``rule``, whether it ``holds``) and the ``paper``'s count
    (millions, table); ``source`` is the run's ``model`` section as written (``RunConfig.model_source``)."""
    source = dict(source or {})
    arch = source.get("arch") or getattr(type(cfg), "arch", "essh")
    out: dict[str, Any] = {"kind": "parameters", "arch": arch, "params": tiers_mod.num_parameters(cfg),
                           "tiers": {t.name: t.params for t in tiers_mod.tier_table(cfg)}}
    if source.get("preset"):
        out["preset"] = source["preset"]
    ref = _reference(source)
    if ref is not None:
        kind = "specialist" if source.get("tier_config") else arch
        tol, rule = RULES.get(kind, (None, ""))
        gap = out["params"] / ref[1] - 1
        out["reference"] = {"model": ref[0], "params": ref[1], "gap": gap, "rule": rule,
                            "holds": None if tol is None else abs(gap) <= tol + 1e-12}
    paper = PAPER_PARAMS_M.get((arch, source.get("preset", ""))) if not source.get("tier_config") else None
    if paper:
        out["paper"] = {"params_m": paper[0], "source": paper[1]}
    return out


def format_report(rep: dict[str, Any]) -> str:
    """One line for the run's log, e.g. ``transformer 370m: 365,560,704 parameters (matched to essh 370m:
    370,866,144, gap -1.43%, Table 8 ... : holds; paper 365.6M, Table 9)``."""
    name = f"{rep['arch']} {rep.get('preset', '')}".strip()
    text = f"{name}: {rep['params']:,} parameters"
    if len(rep["tiers"]) > 1:
        text += f" (tiers {min(rep['tiers'].values()):,}..{max(rep['tiers'].values()):,})"
    extra = []
    if "reference" in rep:
        r = rep["reference"]
        verdict = "" if r["holds"] is None else f": {'holds' if r['holds'] else 'DOES NOT HOLD'}"
        extra.append(f"matched to {r['model']}: {r['params']:,}, gap {100 * r['gap']:+.2f}%"
                     + (f", {r['rule']}{verdict}" if r["rule"] else ""))
    if "paper" in rep:
        extra.append(f"paper {rep['paper']['params_m']}M, {rep['paper']['source']}")
    return text + (f" ({'; '.join(extra)})" if extra else "")
