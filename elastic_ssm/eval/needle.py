"""Needle-in-a-haystack key retrieval by tier (ESSH Appendix E.4, H.1-H.2, Tables 1(b), 17, 18; docs/evaluation.md
states the protocol and the metrics): a ``context_len``-token trial ``[filler ... NEEDLE(key) ... filler] QUERY``
is scored on the key's digits, each key pair (planted, counterfactual) at every depth."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from annotated_types import Len

from ..config import ConfigBase, ConfigError, TierLike, opt
from ..config.base import AtLeast1, NonNeg, Unit
from ..utils.progress import progress as progress_bar
from .perplexity import continuation_scores, eval_mode

__all__ = ["NeedleConfig", "NeedleTrial", "build_trials", "check_fits", "score_trials", "evaluate_needle",
           "summarize_needle"]


@dataclass(kw_only=True)
class NeedleConfig(ConfigBase):
    """A NIAH run: trial shape, keys and scoring (types and ranges checked by pydantic, ``ConfigBase``)."""

    context_len: AtLeast1 = opt(2048, "tokens of the whole sequence before the answer")
    depths: Annotated[tuple[Unit, ...], Len(1)] = opt((0.1, 0.3, 0.5, 0.7, 0.9), "relative needle depths in [0, 1]")
    n_pairs: AtLeast1 = opt(256, "key pairs (each runs at every depth)")
    key_digits: AtLeast1 = opt(6, "decimal digits of a key")
    condition: Literal["counterfactual", "planted"] = opt("counterfactual", "which key of a pair is inserted")
    needle: str = opt(" The special magic number is {key}. Remember it. ", "needle template holding '{key}'")
    query: str = opt("\nWhat is the special magic number? The special magic number is ", "query after the filler")
    seed: int = opt(0, "keys, filler windows and bootstrap")
    bootstrap: NonNeg = opt(2000, "bootstrap resamples of the half width")
    batch_size: AtLeast1 = opt(8, "sequences per forward pass")

    def validate(self) -> None:
        if "{key}" not in self.needle:
            raise ConfigError("NeedleConfig.needle: the needle template must contain '{key}'")


@dataclass
class NeedleTrial:
    pair: int
    depth: float
    prompt: list[int]            # context_len tokens: filler with the needle, then the query
    expected: list[int]          # tokens of the inserted key (the answer)
    competitor: list[int]        # tokens of the other key of the pair
    needle_at: int               # token index where the needle starts
    result: dict[str, bool] = field(default_factory=dict)


def _keys(rng: np.random.Generator, digits: int) -> tuple[str, str]:
    lo, hi = 10 ** (digits - 1), 10 ** digits
    a = int(rng.integers(lo, hi))
    b = a
    while b == a:
        b = int(rng.integers(lo, hi))
    return str(a), str(b)


def _split_answer(enc: Any, query: str, keys: tuple[str, str]) -> tuple[list[int], list[list[int]]]:
    """Query tokens and the tokens of each key as they follow the query in one encoding. When the
    tokenizer merges the query's trailing whitespace with the key (BPE: ``" 123456"``), the whitespace
    moves to the keys, as lm-eval does with continuations; with bytes the keys are the digits alone."""
    wholes = [enc(query + k) for k in keys]
    for q in (enc(query), enc(query.rstrip())):
        if all(w[:len(q)] == q and len(w) > len(q) for w in wholes):
            return q, [w[len(q):] for w in wholes]
    raise ValueError("the tokenizer merges the end of the query template with the key; end the query with a "
                     "word boundary (e.g. 'is ' or ': ')")


def build_trials(filler: Any, tokenizer: Any, cfg: NeedleConfig) -> list[NeedleTrial]:
    """Trials of ``cfg`` (pair-major, depth-minor) over ``filler`` tokens (any 1-D token sequence, e.g. a
    ``TokenArray``): pair ``i`` takes its filler from a fixed window chosen by ``cfg.seed``."""
    enc = lambda s: [int(t) for t in tokenizer.encode(s)]  # noqa: E731
    rng = np.random.default_rng(cfg.seed)
    trials = []
    for p in range(cfg.n_pairs):
        planted, alternative = _keys(rng, cfg.key_digits)
        inserted, other = (alternative, planted) if cfg.condition == "counterfactual" else (planted, alternative)
        query, (expected, competitor) = _split_answer(enc, cfg.query, (inserted, other))
        needle = enc(cfg.needle.format(key=inserted))
        n_fill = cfg.context_len - len(needle) - len(query)
        if n_fill < 1:
            raise ValueError(f"context_len={cfg.context_len} leaves no room for filler around the "
                             f"{len(needle)}-token needle and {len(query)}-token query")
        if len(filler) < n_fill + 1:
            raise ValueError(f"the filler corpus has {len(filler)} tokens; a trial needs {n_fill}: lower "
                             "--context_len or give a larger filler source (--data)")
        start = int(rng.integers(0, len(filler) - n_fill + 1))
        fill = [int(t) for t in np.asarray(filler[start:start + n_fill]).reshape(-1)]
        for depth in cfg.depths:
            at = int(round(depth * n_fill))
            trials.append(NeedleTrial(p, depth, fill[:at] + needle + fill[at:] + query, expected, competitor, at))
    return trials


def check_fits(model: Any, trials: Sequence[NeedleTrial], cfg: NeedleConfig) -> None:
    """Refuse trials longer than the model accepts (an ES-SSM: its filter length ``seq_len``), naming the largest
    ``context_len`` that fits: a forward holds the prompt and the answer but its last token."""
    limit = model.config.max_seq_len()
    longest = max(len(t.prompt) + max(len(t.expected), len(t.competitor)) - 1 for t in trials)
    if limit is not None and longest > limit:
        answer, fits = longest - cfg.context_len + 1, cfg.context_len - (longest - limit)
        raise ValueError(f"context_len={cfg.context_len} makes forwards of {longest} tokens (the context and all but "
                         f"the last of the {answer}-token answer), more than the {limit} this {model.arch} model "
                         f"accepts; give context_len={fits} or less")


def score_trials(model: Any, trials: Sequence[NeedleTrial], tier: TierLike = None, batch_size: int = 8,
                 precision: str = "fp32", bar: Any = None) -> list[NeedleTrial]:
    """Fill each trial's ``result`` (``full_key``, ``first_token``, ``margin_win``) at ``tier``; ``bar`` (a progress
    bar) advances by the trials of each batch."""
    with eval_mode(model):
        for s in range(0, len(trials), batch_size):
            chunk = trials[s:s + batch_size]
            prompts = [t.prompt for t in chunk]
            exp = continuation_scores(model, tier, prompts, [t.expected for t in chunk], precision)
            comp = continuation_scores(model, tier, prompts, [t.competitor for t in chunk], precision)
            for t, (e_score, hits), (c_score, _) in zip(chunk, exp, comp):
                t.result = {"full_key": all(hits), "first_token": hits[0], "margin_win": e_score > c_score}
            if bar is not None:
                bar.update(len(chunk))
    return list(trials)


def _bootstrap_half_width(per_pair: np.ndarray, replicates: int, seed: int) -> float:
    """Half-width of the 95% percentile interval of the mean of ``per_pair`` [n_pairs, n_depths]
    outcomes, resampling pairs (rows) with replacement."""
    n = per_pair.shape[0]
    if replicates == 0 or n < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    means = per_pair[rng.integers(0, n, size=(replicates, n))].mean(axis=(1, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(hi - lo) / 2


def summarize_needle(trials: Sequence[NeedleTrial], cfg: NeedleConfig) -> dict[str, Any]:
    """Means of the three metrics, the bootstrap half-width of full-key accuracy, and full-key accuracy
    per depth (Table 17 / Table 18 layout)."""
    row = {p: i for i, p in enumerate(sorted({t.pair for t in trials}))}
    col = {d: j for j, d in enumerate(sorted({t.depth for t in trials}))}
    grid = np.zeros((len(row), len(col)))                                   # [pairs, depths] full-key outcomes
    for t in trials:
        grid[row[t.pair], col[t.depth]] = t.result["full_key"]
    mean = lambda k: float(np.mean([t.result[k] for t in trials]))  # noqa: E731
    return {"trials": len(trials), "margin_win": mean("margin_win"), "first_token": mean("first_token"),
            "full_key": mean("full_key"), "half_width": _bootstrap_half_width(grid, cfg.bootstrap, cfg.seed),
            "by_depth": {f"{d:g}": float(grid[:, j].mean()) for d, j in col.items()}}


def evaluate_needle(model: Any, filler: Any, tokenizer: Any, tiers: Sequence[Any] | None = None,
                    cfg: NeedleConfig | None = None, precision: str = "fp32",
                    trials: list[NeedleTrial] | None = None, progress: bool = False) -> list[dict[str, Any]]:
    """NIAH rows (tier, K, n_ff, params, context_len, condition and ``summarize_needle``'s numbers) for every tier
    of ``tiers`` (default: the tier table) on the same trials; ``trials``: ``build_trials``' when already built."""
    cfg = cfg or NeedleConfig()
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has {vocab}")
    trials = build_trials(filler, tokenizer, cfg) if trials is None else trials
    check_fits(model, trials, cfg)
    tiers = [model.resolve_tier(t) for t in (tiers if tiers is not None else model.tier_table())]
    rows = []
    with progress_bar(desc="niah", total=len(tiers) * len(trials), enabled=progress, unit="trial") as bar:
        for t in tiers:
            bar.set_postfix_str(t.name)
            scored = score_trials(model, trials, t, cfg.batch_size, precision, bar=bar)
            rows.append({"tier": t.name, "K": t.K, "n_ff": t.n_ff, "params": t.params,
                         "context_len": cfg.context_len, "condition": cfg.condition,
                         **summarize_needle(scored, cfg)})
    return rows
