"""Synthetic recall tasks of the ESSH paper's Appendix I, as ``(input_ids [N, L], labels [N, L])`` int64 (labels
``IGNORE`` = -100 where not scored), seeded; ``synthetic_batches``' batch ``s`` depends only on ``(seed, s)``.

MQAR (Arora et al., 2024; Tables 21-22): ``num_pairs`` bigrams ``k1 v1 k2 v2 ...`` (distinct keys from the lower half
of the vocabulary, values from the upper half), then filler (id 0) in which ``num_queries`` keys reappear, each
followed by its (scored) value. Palindrome: Table 23, ``palindrome``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator

import numpy as np
import torch

IGNORE = -100
MQAR_FILLER = 0
PAL_PAD, PAL_SEP = 0, 1


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _shift(seq: np.ndarray, scored: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq [N, L + 1]`` and a mask of scored tokens ``[N, L + 1]`` -> ``(input_ids, labels)`` ``[N, L]``."""
    labels = np.where(scored[:, 1:], seq[:, 1:], IGNORE)
    return torch.from_numpy(seq[:, :-1].astype(np.int64)), torch.from_numpy(labels.astype(np.int64))


def mqar(num_examples: int, seq_len: int, num_pairs: int, vocab_size: int = 8192,
         num_queries: int | None = None, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR examples ``(input_ids [N, L], labels [N, L])`` (module docstring); the queried keys (``num_queries``,
    default ``num_pairs``) are a random subset of the context keys at random bigram slots after the context."""
    q = num_pairs if num_queries is None else num_queries
    half = vocab_size // 2
    ctx, slots = 2 * num_pairs, (seq_len + 1 - 2 * num_pairs) // 2
    if num_pairs < 1 or not 1 <= q <= num_pairs:
        raise ValueError(f"need 1 <= num_queries ({q}) <= num_pairs ({num_pairs})")
    if half - 1 < num_pairs:
        raise ValueError(f"vocab_size={vocab_size} leaves {half - 1} keys, fewer than num_pairs={num_pairs}")
    if slots < q:
        raise ValueError(f"seq_len={seq_len} too short for {num_pairs} pairs and {q} queries: need "
                         f"seq_len >= {2 * num_pairs + 2 * q - 1}")
    rng = _rng(seed)
    n = num_examples
    keys = np.stack([rng.choice(np.arange(1, half), num_pairs, replace=False) for _ in range(n)])  # [N, P]
    values = rng.integers(half, vocab_size, size=(n, num_pairs))  # [N, P]
    seq = np.full((n, seq_len + 1), MQAR_FILLER, dtype=np.int64)
    scored = np.zeros((n, seq_len + 1), dtype=bool)
    seq[:, 0:ctx:2], seq[:, 1:ctx:2] = keys, values
    rows = np.arange(n)[:, None]
    which = np.argsort(rng.random((n, num_pairs)), axis=1)[:, :q]  # queried pairs [N, Q]
    slot = np.sort(np.argsort(rng.random((n, slots)), axis=1)[:, :q], axis=1)  # [N, Q]
    pos = ctx + 2 * slot
    seq[rows, pos], seq[rows, pos + 1] = keys[rows, which], values[rows, which]
    scored[rows, pos + 1] = True
    return _shift(seq, scored)


def palindrome(num_examples: int, seq_len: int, vocab_size: int = 16, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Palindrome completion (Table 23) ``(input_ids [N, L], labels [N, L])``: ``x SEP reverse(x)``, ``len(x) = L //
    2`` symbols from ``[2, vocab_size)``, SEP = 1 (odd L: one PAD = 0 at the end); the reversed half is scored."""
    if vocab_size < 3:
        raise ValueError(f"vocab_size={vocab_size} must be >= 3 (pad, separator and at least one symbol)")
    half = seq_len // 2
    if half < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    rng = _rng(seed)
    x = rng.integers(2, vocab_size, size=(num_examples, half))  # [N, n]
    seq = np.full((num_examples, seq_len + 1), PAL_PAD, dtype=np.int64)
    scored = np.zeros_like(seq, dtype=bool)
    seq[:, :half], seq[:, half] = x, PAL_SEP
    seq[:, half + 1 : 2 * half + 1] = x[:, ::-1]
    scored[:, half + 1 : 2 * half + 1] = True
    return _shift(seq, scored)


TASKS = {"mqar": mqar, "palindrome": palindrome}


def synthetic_batches(task: str, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0,
                      shard: int = 0, **kwargs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of ``task``; batch ``s`` uses seed ``(seed, s)`` (``(seed, s, shard)`` for ``shard > 0``:
    one stream per rank); ``kwargs`` go to the generator (``num_pairs=``, ``vocab_size=``)."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}: choose from {sorted(TASKS)}")
    for step in itertools.count(start_step):
        key = [seed, step] if shard == 0 else [seed, step, shard]
        yield TASKS[task](batch_size, seq_len, seed=np.random.default_rng(key), **kwargs)


class SyntheticSource:
    """A run's data source ``"synthetic:<task>[:key=value,...]"`` (``synthetic:mqar:num_pairs=16``; ``vocab_size``
    defaults to the model's): ``batches`` is ``train()``'s ``data(rank, world_size)`` factory (a stream per rank),
    ``validation`` a fixed held-out set from a seed no training batch uses."""

    def __init__(self, spec: str, vocab_size: int) -> None:
        parts = spec.split(":", 2)
        if len(parts) < 2 or parts[0] != "synthetic" or parts[1] not in TASKS:
            raise ValueError(f"bad synthetic source {spec!r}: use 'synthetic:<task>[:key=value,...]' with a task "
                             f"from {sorted(TASKS)}")
        self.spec, self.task = spec, parts[1]
        self.kwargs: dict[str, int] = {"vocab_size": vocab_size}
        for item in filter(None, (parts[2] if len(parts) > 2 else "").split(",")):
            key, eq, value = item.partition("=")
            if not eq or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"bad option {item!r} in {spec!r}: write key=integer, e.g. num_pairs=16")
            self.kwargs[key.strip()] = int(value)
        allowed = set(inspect.signature(TASKS[self.task]).parameters) - {"num_examples", "seq_len", "seed"}
        if set(self.kwargs) - allowed:
            raise ValueError(f"{spec!r}: unknown option(s) {sorted(set(self.kwargs) - allowed)} for "
                             f"{self.task}; it takes {sorted(allowed)}")
        if self.kwargs["vocab_size"] > vocab_size:
            raise ValueError(f"{spec!r} uses vocab_size={self.kwargs['vocab_size']} but the model has {vocab_size}")

    def batches(self, seq_len: int, batch_size: int, seed: int):
        def make(rank: int = 0, world_size: int = 1):
            return synthetic_batches(self.task, batch_size, seq_len, seed=seed, shard=rank, **self.kwargs)
        return make

    def validation(self, seq_len: int, batch_size: int, n_batches: int, seed: int) -> list[tuple]:
        x, y = TASKS[self.task](batch_size * n_batches, seq_len, seed=np.random.default_rng([seed, 2**31 - 1]),
                                **self.kwargs)
        return list(zip(x.split(batch_size), y.split(batch_size)))


def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of scored positions (``labels != -100``) whose argmax over ``logits [N, L, V]`` is right."""
    mask = labels != IGNORE
    if not bool(mask.any()):
        raise ValueError("no scored positions in labels")
    return (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
