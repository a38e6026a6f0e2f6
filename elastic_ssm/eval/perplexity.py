"""Per-tier held-out loss, perplexity and bits-per-byte of one shared model (or of exports).

``evaluate_tiers`` runs the shared model at every requested tier (a named tier or any capacity fraction ``xi``,
Eq. 7) on the same fixed batches (ESSH E.4). Bits per byte = loss_nats / ln 2 / bytes_per_token (of a subword
tokenizer: ``measured_bytes_per_token`` on the evaluated text). ``loss_sums`` is
the scoring loop, shared with the channel knock-out (``importance.py``); ``continuation_scores`` the teacher-forced
scores of continuations, shared by the lm-eval adapter and the needle probe.

Needle-in-a-haystack key retrieval by tier (ESSH Appendix E.4, H.1-H.2, Tables 1(b), 17, 18; docs/evaluation.md
states the protocol and the metrics): a ``context_len``-token trial ``[filler ... NEEDLE(key) ... filler] QUERY``
is scored on the key's digits, each key pair (planted, counterfactual) at every depth."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from annotated_types import Len
from torch.func import functional_call
from torch.nn.utils.rnn import pad_sequence

from ..config import ConfigBase, ConfigError, TierLike, opt
from ..config.base import AtLeast1, NonNeg, Unit
from ..utils.progress import format_table
from ..utils.progress import progress as progress_bar


@contextmanager
def eval_mode(*modules: torch.nn.Module) -> Iterator[None]:
    """The block runs with every module of ``modules`` in eval mode; each gets its own training flag back after."""
    flags = [m.training for m in modules]
    try:
        for m in modules:
            m.eval()
        yield
    finally:
        for m, flag in zip(modules, flags):
            m.train(flag)


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped at ``exp(700)`` (no float overflow)."""
    return math.exp(min(loss, 700.0))


@dataclass
class TierEval:
    tier: str
    K: int
    n_ff: int
    params: int
    loss: float          # mean cross-entropy in nats (next token, or the class for classifiers)
    tokens: int          # scored positions (sequences for classifiers)
    bytes_per_token: float
    accuracy: float | None = None   # argmax == label over scored positions (next token; class for classifiers)
    xi: float | None = None         # the budget variable of Eq. 7 (ES-SSM: K / K-bar)
    seq_len: int | None = None      # tokens per evaluated sequence (None when the batches differ in length)

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    @property
    def bpb(self) -> float:
        return self.loss / math.log(2) / self.bytes_per_token

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity, "bpb": self.bpb}


@torch.no_grad()
def evaluate_tiers(model: Any, batches: Sequence[tuple[torch.Tensor, ...]], tiers: Iterable[Any] | None = None,
                   bytes_per_token: float = 1.0, precision: str = "fp32",
                   reduce: Callable[[torch.Tensor], Any] | None = None, progress: bool = False) -> list[TierEval]:
    """Mean CE of ``model(x, tier=t)`` on ``batches`` (``(input_ids [B,T], labels [B,T] or [B], optional
    attention_mask [B,T])``, labels -100 ignored) for every tier (default: the tier table); ``reduce`` (a
    distributed all-reduce) is applied to the per-tier sums ``[loss, count, correct]`` before averaging."""
    tiers = [model.resolve_tier(t) for t in (tiers if tiers is not None else model.tier_table())]
    lengths = {int(b[0].shape[1]) for b in batches}
    seq_len = lengths.pop() if len(lengths) == 1 else None
    out = []
    bar = progress_bar(desc="eval" + (f" L={seq_len}" if seq_len else ""), total=len(tiers) * len(batches),
                       enabled=progress, unit="batch")
    with eval_mode(model), bar:
        for t in tiers:
            bar.set_postfix_str(t.name)
            tot = loss_sums(model, batches, t, precision, reduce=reduce, bar=bar)
            count = int(tot[1].item())
            out.append(TierEval(t.name, t.K, t.n_ff, t.params, (tot[0] / count).item(), count, bytes_per_token,
                                (tot[2] / count).item(), xi=t.xi, seq_len=seq_len))
    return out


@torch.no_grad()
def loss_sums(model: Any, batches: Sequence[tuple[torch.Tensor, ...]], tier: TierLike, precision: str = "fp32", *,
              params: dict[str, torch.Tensor] | None = None, reduce: Callable[[torch.Tensor], Any] | None = None,
              bar: Any = None) -> torch.Tensor:
    """``[summed CE in nats, scored positions, argmax hits]`` (float64 [3]) of ``model(x, tier=tier)`` over
    ``batches`` (as for ``evaluate_tiers``) on the device of ``model``'s parameters, after ``reduce``; ``params``
    replace some of the model's tensors (``torch.func.functional_call``); ``bar`` advances once per batch. Batches
    without a scored position are a ``ValueError``."""
    device = next(model.parameters()).device
    tot = torch.zeros(3, dtype=torch.float64, device=device)      # loss sum, count, correct
    for batch in batches:
        x, y = batch[0].to(device), batch[1].to(device)
        kw = {"tier": tier, **({"attention_mask": batch[2].to(device)} if len(batch) > 2 else {})}
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x, **kw) if params is None else functional_call(model, params, (x,), kw)
        flat = logits.float().reshape(-1, logits.shape[-1])
        tot[0] += F.cross_entropy(flat, y.reshape(-1), ignore_index=-100, reduction="sum").double()
        valid = y != -100
        tot[1] += valid.sum()
        tot[2] += ((logits.argmax(-1) == y) & valid).sum()
        if bar is not None:
            bar.update()
    if reduce is not None:
        reduce(tot)
    if tot[1].item() == 0:
        raise ValueError("evaluation batches contain no scored tokens")
    return tot


@torch.no_grad()
def continuation_scores(model: Any, tier: TierLike, contexts: Sequence[list[int]], continuations: Sequence[list[int]],
                        precision: str = "fp32") -> list[tuple[float, list[bool]]]:
    """``[(sum log p(continuation | context), per-token argmax hits)]`` for each row, from one right-padded causal
    forward of ``context + continuation[:-1]`` per row; every context and continuation needs at least one token.
    ``tier`` None runs the model as it is; ``precision="bf16"`` runs the forward under bf16 autocast."""
    device = next(model.parameters()).device
    x = pad_sequence([torch.tensor(list(c) + list(k[:-1]), dtype=torch.long) for c, k in zip(contexts, continuations)],
                     batch_first=True).to(device)                                           # [B, T], 0 after a row
    with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
        logits = model(x, tier=tier) if tier is not None else model(x)
    out = []
    for i, (c, k) in enumerate(zip(contexts, continuations)):
        lp = F.log_softmax(logits[i, len(c) - 1:len(c) - 1 + len(k)].float(), dim=-1)    # [len(k), V]
        target = torch.tensor(k, device=lp.device)
        out.append((float(lp.gather(-1, target[:, None]).sum()), (lp.argmax(-1) == target).tolist()))
    return out


def split_windows(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> list[tuple[torch.Tensor, ...]]:
    """Every ``(input_ids [b, L], labels [b, L])`` batch cut into consecutive windows ``[b * (L // length),
    length]``: the length sweep scores the same labels at every length, with less context."""
    out = []
    for x, y in batches:
        n = x.shape[1] // length
        if n < 1:
            raise ValueError(f"cannot cut windows of {x.shape[1]} tokens into pieces of {length}")
        out.append(tuple(t[:, :n * length].reshape(t.shape[0] * n, length) for t in (x, y)))  # [b*n, length]
    return out


def format_evals(rows: Sequence[TierEval]) -> str:
    """The rows as a text table; an ``xi`` column when a row is a capacity fraction (not a named tier) and a
    ``length`` column when the rows were evaluated at more than one sequence length."""
    columns = ["tier", *(["xi"] * any(not r.tier[1:].isdigit() for r in rows)),
               *(["length"] * (len({r.seq_len for r in rows}) > 1)), "K", "n_ff", "params", "loss", "ppl", "bpb"]
    return format_table([{"tier": r.tier, "xi": r.xi, "length": r.seq_len, "K": r.K, "n_ff": r.n_ff,
                          "params": f"{r.params:,}", "loss": f"{r.loss:.4f}", "ppl": f"{r.perplexity:.3f}",
                          "bpb": f"{r.bpb:.4f}"} for r in rows], columns)


def format_length_sweep(rows: Sequence[TierEval]) -> str:
    """Bits per byte of every tier (rows) at every evaluated sequence length (columns)."""
    lengths = sorted({r.seq_len for r in rows if r.seq_len is not None})
    table: dict[str, dict[str, Any]] = {}
    for r in rows:
        table.setdefault(r.tier, {"bpb": r.tier})[f"L={r.seq_len}"] = f"{r.bpb:.4f}"
    return format_table(list(table.values()), ["bpb", *(f"L={n}" for n in lengths)])


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
    lo, hi = 10 ** (cfg.key_digits - 1), 10 ** cfg.key_digits
    for p in range(cfg.n_pairs):
        planted = alternative = str(rng.integers(lo, hi))      # the pair's two distinct keys
        while alternative == planted:
            alternative = str(rng.integers(lo, hi))
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


def measured_bytes_per_token(tokenizer, tokens, max_tokens: int = 1 << 20) -> float:
    """UTF-8 bytes of the decoded text per token over the first ``max_tokens`` of ``tokens`` (anything sliceable to
    1-D ids): the bits-per-byte divisor of a subword tokenizer (ES-SSM Sec. 5); specials count, with no bytes."""
    n = min(len(tokens), int(max_tokens))
    if n <= 0:
        raise ValueError("measured_bytes_per_token: no tokens to measure on")
    return len(tokenizer.decode(np.asarray(tokens[:n])).encode("utf-8")) / n
