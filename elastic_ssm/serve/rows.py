"""Row bookkeeping of a slot pool: row views of a cache, left padding, prefill grouping, ``SlotRows``."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from ..models.cache import ESSHCache

__all__ = ["SlotRows", "row_cache", "reset_row_", "left_pad", "prefill_groups", "raised_in_fla"]


def raised_in_fla(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) was raised inside fla (the torch scan goes around it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any("/fla/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.__traceback__)):
            return True
        error = error.__cause__ or error.__context__
    return False


def row_cache(cache: ESSHCache, i: int) -> ESSHCache:
    """A batch-1 cache of views of row ``i`` of ``cache`` (writes land in ``cache``)."""
    if not 0 <= i < cache.batch:
        raise IndexError(f"row {i} is outside a cache of {cache.batch} rows")
    return cache.narrow(1, start=i)


def reset_row_(cache: ESSHCache, i: int) -> ESSHCache:
    """Empty sequence ``i`` of ``cache`` in place; returns its row view, ready for a prefill."""
    return row_cache(cache, i).reset_()


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ids [n, T]`` of prompts left-padded (id 0) to the longest, ``T``, and the mask of real tokens ``[n, T]``
    (None when every prompt has ``T`` tokens: the unmasked forward)."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = True
    same = all(len(p) == T for p in prompts)
    return ids.to(device), (None if same else mask.to(device))


def prefill_groups(lengths: list[int], max_prefill: int, max_tokens: int | None = None, pad_ratio: float = 1.25,
                   pad_tokens: int = 2048) -> list[list[int]]:
    """Prompt indices grouped for batched prefill: by length, a prompt joins the current group while it stays within
    ``max_prefill`` prompts and ``max_tokens`` padded tokens (None: no bound) and the padding is at most
    ``pad_ratio`` x the real tokens or ``pad_tokens`` more (docs/serving.md)."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        L = lengths[i]
        padded, total = ((len(groups[-1]) + 1) * L, real + L) if groups else (0, 0)
        if groups and len(groups[-1]) < max_prefill and (max_tokens is None or padded <= max_tokens):
            if padded <= pad_ratio * total or padded - total <= pad_tokens:
                groups[-1].append(i)
                real = total
                continue
        groups.append([i])
        real = L
    return groups


class SlotRows:
    """Which request holds which of ``slots`` rows (``owner[i]``; None: free): ``SlotPool``'s and ``StubPool``'s."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.owner: list[Any] = [None] * slots

    def free_slots(self) -> int:
        return sum(o is None for o in self.owner)

    def busy(self) -> int:
        return self.slots - self.free_slots()

    def active_rows(self) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o is not None]

    def free_rows(self, n: int) -> list[int]:
        """The first ``n`` free rows (fewer when fewer are free)."""
        return [i for i, o in enumerate(self.owner) if o is None][:n]

    def free_run(self, n: int) -> int | None:
        """First row of ``n`` consecutive free rows, or None when the free rows are more scattered."""
        run = 0
        for i, o in enumerate(self.owner):
            run = run + 1 if o is None else 0
            if run == n:
                return i - n + 1
        return None

    def release(self, i: int) -> None:
        """Free row ``i`` at once (finished, cancelled or failed); it is reset when next admitted."""
        self.owner[i] = None
