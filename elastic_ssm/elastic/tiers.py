"""Capacity tiers: tier tables, resolution and exact per-tier costs, the functional front of each config's own
methods (``ModelConfig``; no switch over config types). docs/tiers.md states every rule: ESSH's two-rate map (Sec.
4.2, Eq. 7; Table 6), parameters by Eq. 25 (C.5, Table 4), state by C.5 and Table 53; ES-SSM one tier per budget
``K``; Transformer++ / MatFormer nested FFN tiers only (``K = 0``, Table 39).

Parameter matching of the baselines, reported with every run (ESSH Appendix E.6, Tables 8, 9, 39, 54; the rules are
``RULES``; a mixer-only ESSH, Tables 21-23, is reported, not matched). ``elastic-ssm train`` prints
``format_report`` before the first step and writes ``<out_dir>/parameters.json``.

The model card (``README.md``) written by ``save_pretrained`` into every exported tier directory, ``model_card``: the
tier and its parent's sizes, exact parameter count, decoding state in bytes (ESSH Table 53), tokenizer, quality when
known, and how to load the directory with this library and with Hugging Face ``transformers``."""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from numbers import Integral
from typing import Any

from .. import __version__
from ..config import ConfigError, ESSHConfig, model_config_from_dict, tier_word
from ..config.model import FractionTierConfig, ModelConfig, Tier, TierLike
from ..utils.progress import format_table

__all__ = ["Tier", "TierLike", "tier_table", "resolve_tier", "capacity_tier", "channels_for", "ffn_width_for",
           "num_parameters", "parameter_breakdown", "state_bytes", "flops_per_token", "format_tier_table", "tier_width",
           "PAPER_PARAMS_M", "parameter_report", "format_report", "check_counts", "model_card"]


def _model_config(cfg: Any, what: str) -> ModelConfig:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"{what} needs a model config (ESSHConfig, ESSSMConfig, TransformerConfig, ...), got "
                        f"{type(cfg).__name__}")
    return cfg


def _fraction_config(cfg: Any, what: str) -> FractionTierConfig:
    if not isinstance(cfg, FractionTierConfig):
        raise TypeError(f"{what} is the ESSH two-rate map (Eq. 7); got {type(cfg).__name__}")
    return cfg


def channels_for(cfg: Any, xi: float | Fraction) -> int:
    """Retained spectral channels ``K_T = max(1, round(K-bar xi^{1/2}))`` (Eq. 7; ``ESSHConfig.channels_for``)."""
    if not callable(getattr(cfg, "channels_for", None)):
        raise TypeError(f"channels_for is the ESSH channel map (Eq. 7); got {type(cfg).__name__}")
    return cfg.channels_for(xi)


def ffn_width_for(cfg: Any, xi: float | Fraction) -> int:
    """Retained FFN width ``n_ff = align max(1, floor(d_ff xi^{0.8} / align))`` (Eq. 7, Figure 5)."""
    return _fraction_config(cfg, "ffn_width_for").ffn_width_for(xi)


def capacity_tier(cfg: Any, xi: float) -> Tier:
    """The tier of any budget fraction ``xi`` in (0, 1] through Eq. 7 (D.4), named ``"xi=<xi>"``, ``index`` 0."""
    return _fraction_config(cfg, "capacity_tier").capacity_tier(xi)


def tier_table(cfg: ModelConfig) -> list[Tier]:
    """All deployment tiers of ``cfg``, smallest first (ESSH: one per ``cfg.tier_xi`` through Eq. 7, Table 6)."""
    return _model_config(cfg, "tier_table").tier_table()


def resolve_tier(cfg: ModelConfig, tier: TierLike = None) -> Tier:
    """A tier spec (``TierLike``) as a ``Tier`` of ``cfg``; else a ``ValueError`` listing the valid names."""
    return _model_config(cfg, "resolve_tier").resolve_tier(tier)


def parameter_breakdown(cfg: ModelConfig, tier: TierLike = None) -> dict[str, int]:
    """Parameter count of ``tier``'s standalone export by component (ESSH Eq. 25: embedding, head, norms,
    attention, spectral, ffn; ES-SSM: gate instead of attention), plus ``"total"``."""
    return cfg.tier_parameters(resolve_tier(cfg, tier))


def num_parameters(cfg: ModelConfig, tier: TierLike = None) -> int:
    """Exact parameter count of the standalone export of ``tier`` (ESSH Eq. 25; Table 4, Table 6)."""
    return resolve_tier(cfg, tier).params


def check_counts(least: int = 1, **values: Any) -> None:
    """A ``ValueError`` naming the first of ``values`` that is not an int >= ``least`` (a bool, float or NaN is no
    count; numpy ints pass): the one count check of the package's arguments."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def state_bytes(cfg: ModelConfig, tier: TierLike = None, batch: int = 1, state_dtype_bytes: int = 4,
                kv_dtype_bytes: int = 2, decode: str = "exact", n_modes: int = 8,
                context: int = 2048) -> dict[str, int]:
    """Persistent per-batch decoding state in bytes, ``recurrent``, ``kv`` and ``total``, of the entries of
    ``cfg.tier_state`` (C.5, Table 53; docs/tiers.md); ``decode`` / ``n_modes``: ES-SSM's exact or modal decoder."""
    check_counts(batch=batch, state_dtype_bytes=state_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, n_modes=n_modes,
                 context=context)
    if decode not in ("exact", "modal"):
        raise ValueError(f"decode must be 'exact' or 'modal', got {decode!r}")
    rec, kv = cfg.tier_state(resolve_tier(cfg, tier), decode=decode, n_modes=n_modes, context=context)
    out = {"recurrent": batch * rec * state_dtype_bytes, "kv": batch * kv * kv_dtype_bytes}
    out["total"] = out["recurrent"] + out["kv"]
    return out


def flops_per_token(cfg: ModelConfig, tier: TierLike = None, context: int = 2048) -> dict[str, int]:
    """Per-token FLOPs (a multiply-accumulate = 2, C.5) of ``tier``: ``projection``, ``ffn``, ``attention``, ``scan``,
    ``head`` and ``total`` (ESSH: Eq. 9, 23, 24 per spectral block; ES-SSM: the FFT convolution at ``context``)."""
    check_counts(context=context)
    return cfg.tier_flops(resolve_tier(cfg, tier), context)


def tier_width(tier: Any, full: int, field: str = "K") -> int:
    """``field`` (``K`` or ``n_ff``) of ``tier``: a ``Tier``'s own, an int as given, or ``full`` for None."""
    return full if tier is None else int(getattr(tier, field, tier))


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(int(n))


def format_tier_table(rows: Iterable[Tier], cfg: ModelConfig | None = None, batch: int = 1,
                      n_modes: tuple[int, ...] = (4, 8, 16)) -> str:
    """A plain-text table of tiers: name, xi, K, n_ff, params (exact and rounded) and fraction r; with ``cfg``
    also the decode state of ``state_bytes`` at ``batch`` in MB (``ModelConfig.state_columns``; ES-SSM: exact and
    modal at each m in ``n_modes``)."""
    rows = list(rows)
    if not rows:
        raise ValueError("format_tier_table needs at least one Tier")
    full = max(r.params for r in rows) if cfg is None else num_parameters(cfg)
    head = ["tier", "xi", "K", "n_ff", "params", "", "r"]
    body = []
    for r in rows:
        line = [r.name, f"{r.xi:.4f}", r.K, r.n_ff, f"{r.params:,}", _human(r.params), f"{r.params / full:.3f}"]
        extra = [] if cfg is None else cfg.state_columns(r, state_bytes, batch, n_modes)
        body.append(dict(zip(head + [h for h, _ in extra], line + [cell for _, cell in extra])))
    return format_table(body, list(body[0]))


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
        t = resolve_tier(parent, tier_word(tier))
        return f"{t.name} of {arch} {preset or '(fields)'}", t.params
    if arch == "essh" and preset and preset.endswith("-mixer"):     # Tables 21-23: reported, not matched
        return f"essh {preset[:-6]} (hybrid)", num_parameters(ESSHConfig.preset(preset[:-6]))
    if arch in ("transformer", "matformer") and preset:
        try:
            return f"essh {preset}", num_parameters(ESSHConfig.preset(preset))
        except ConfigError:
            return None
    return None


def parameter_report(cfg: Any, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameter counts of a run's model ``cfg`` (``params``, ``tiers``) and, when known, its ``reference``
    (the model matched to: ``params``, relative ``gap``, ``rule``, whether it ``holds``) and the ``paper``'s count
    (millions, table); ``source`` is the run's ``model`` section as written (``RunConfig.model_source``)."""
    source = dict(source or {})
    arch = source.get("arch") or getattr(type(cfg), "arch", "essh")
    out: dict[str, Any] = {"kind": "parameters", "arch": arch, "params": num_parameters(cfg),
                           "tiers": {t.name: t.params for t in tier_table(cfg)}}
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


#: what a tier of each arch keeps (Transformer++ / MatFormer: nested FFN units only)
RETAINED = {"essh": "spectral-channel and feed-forward", "es_ssm": "spectral-channel"}


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    return f"{n:,} B ({n / 1024:.1f} KiB)" if n < 2**20 else f"{n:,} B ({n / 2**20:.1f} MiB)"


def model_card(model: Any, quality: dict[str, float] | None = None) -> str:
    """Markdown text of the card of ``model`` (a standalone export). ``quality``: metric name -> value
    (e.g. held-out bits per byte), printed when given; else the card says it was not measured."""
    cfg, source = model.config, model.source or {}
    tier = source.get("tier", "full")
    params = model.num_parameters()
    state = state_bytes(cfg)
    tok = model.tokenizer
    loader = "models.load_pretrained"
    tok_line = "none saved (pass one with --tokenizer)" if tok is None else \
        f"{'byte-level (bytes 0-255 + 4 specials)' if tok.vocab_size <= 260 else 'BPE'}, {tok.vocab_size:,} ids " \
        f"(`tokenizer.json`, `tokenizer_config.json`)"
    lines = [
        f"# elastic_ssm {model.arch.upper()} export, tier {tier}",
        "",
        f"A standalone {model.arch} model cut from a shared elastic model at tier **{tier}** "
        "(train once, export many): it holds only the retained "
        f"{RETAINED.get(model.arch, 'feed-forward')} prefixes.",
        "",
        "| | |",
        "|---|---|",
        f"| tier | {tier} |",
        f"| parameters | {params:,} |",
    ]
    parent = source.get("parent_config")
    if parent:
        pcfg = model_config_from_dict({"arch": model.arch, **parent})
        lines.append(f"| parameters of the shared model | {num_parameters(pcfg):,} |")
    if model.arch == "essh":
        lines += [f"| spectral channels K / FFN width | {cfg.n_channels} / {cfg.d_ff} |",
                  f"| layers / width / vocabulary | {cfg.n_layers} / {cfg.d_model} / {cfg.vocab_size:,} |"]
    detail = {"essh": f"recurrent {_size(state['recurrent'])} fp32, window ring {_size(state['kv'])} bf16",
              "es_ssm": "the last L-1 normalised inputs per block, fp32"}.get(
        model.arch, "bf16 K and V of every layer at 2048 tokens of context (full attention)")
    lines += [f"| decoding state per sequence | {_size(state['total'])} ({detail}) |", f"| tokenizer | {tok_line} |"]
    if quality:
        lines += [f"| {k} | {v:.4f} |" for k, v in quality.items()]
    else:
        lines.append("| quality | not measured at export (`elastic-ssm eval DIR`) |")
    lines += [
        "",
        "## Load with elastic_ssm",
        "",
        "```python",
        "import elastic_ssm as es",
        f"model = es.{ {'essh': 'ESSH.from_pretrained', 'es_ssm': 'ESSSM.from_pretrained'}.get(model.arch, loader)}"
        "(\"DIR\")          # model.tokenizer is the saved tokenizer",
        "ids = model.tokenizer.encode(\"def main():\")",
    ]
    if model.arch == "essh":
        lines += ["import torch",
                  "out = model.generate(torch.tensor([ids]), max_new_tokens=32)",
                  "print(model.tokenizer.decode(out[0].tolist()))",
                  "```",
                  "",
                  "Command line: `elastic-ssm generate DIR --prompt \"def \"`, `elastic-ssm eval DIR`.",
                  "",
                  "## Load with Hugging Face transformers (`pip install 'elastic-ssm[hf]'`)",
                  "",
                  "```python",
                  "import elastic_ssm.hf  # registers model_type 'essh' with AutoConfig / AutoModelForCausalLM",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(\"DIR\")",
                  "model = AutoModelForCausalLM.from_pretrained(\"DIR\")",
                  "out = model.generate(**tok(\"def main():\", return_tensors=\"pt\"), max_new_tokens=32)",
                  "```"]
    else:
        lines += ["import torch", "logits = model(torch.tensor([ids]))", "```"]
    lines += ["", f"Written by elastic_ssm {__version__}."]
    return "\n".join(lines) + "\n"
