"""Per-tier held-out loss, perplexity and bits-per-byte of one shared model (or of exports).

``evaluate_tiers`` runs the shared model at every requested tier (a named tier or any capacity fraction ``xi``,
Eq. 7) on the same fixed batches (ESSH E.4). Bits per byte = loss_nats / ln 2 / bytes_per_token. ``loss_sums`` is
the scoring loop, shared with the channel knock-out (``importance.py``); ``continuation_scores`` the teacher-forced
scores of continuations, shared by the lm-eval adapter and the needle probe."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.utils.rnn import pad_sequence

from ..config import TierLike
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
