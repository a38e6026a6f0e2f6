"""Prompt prefill replayed from a CUDA graph per (decoder, length bucket): the trunk (compiled when
``compile_model`` was called) into a cache, the last position's logits. Prompts are left-padded to
``length_bucket``; extra rows of the batch bucket repeat the first. docs/performance.md, "Graphed compiled prefill"."""

from __future__ import annotations

import torch

from .cache import ESSHCache
from .compile import capture_graph, compiled_trunk, scan_backend, trunk_for
from .generation import token_positions

__all__ = ["PrefillGraph", "length_bucket", "GRAPH_TOKENS"]

#: the most padded prompt tokens (rows x length bucket) a prefill graph of an eager trunk takes; larger prefills run
#: eagerly (the measurement: docs/performance.md, "Graphed compiled prefill")
GRAPH_TOKENS = 2048


def length_bucket(T: int, min_step: int = 256) -> int:
    """The captured prompt length serving T tokens: T rounded up to a multiple of max(2^(bits(T) - 4),
    ``min_step``) (a power of two): at most 1/8 of padding once T > 8 ``min_step``."""
    if T < 1:
        raise ValueError(f"a prompt needs at least one token, got length {T}")
    if min_step < 1 or min_step & (min_step - 1):
        raise ValueError(f"min_step must be a power of two, got {min_step}")
    step = max(min_step, 1 << max(0, T.bit_length() - 4))
    return -(-T // step) * step


class PrefillGraph:
    """Prefill of ``cache.batch`` prompts of ``length`` tokens (``padded``: up to ``length``, left-padded) at
    ``cache.tier`` into ``cache``. ``graph=False`` runs the static-buffer function eagerly (CPU tests); ``pool``:
    the CUDA graph memory pool of one model's prefill graphs (they never overlap)."""

    def __init__(self, model, cache: ESSHCache, length: int, padded: bool, graph: bool = True, pool=None,
                 row_tiers: bool = False) -> None:
        self.model, self.cache, self.length, self.padded = model, cache, length, padded
        B, dev = cache.batch, cache.positions.device
        # row_tiers: each call names one tier per row (nested in cache.tier), written into static factors
        self.rows = model.row_tiers([cache.tier] * B, cache.tier) if row_tiers else None
        self.ids = torch.zeros(B, length, dtype=torch.long, device=dev)
        self.mask = torch.ones(B, length, dtype=torch.bool, device=dev) if padded else None
        self._positions = torch.arange(length, device=dev).expand(B, length)
        self._backend = scan_backend(model, "auto", dev)
        self._trunk = trunk_for(model)
        self.compiled = compiled_trunk(model) is not None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        if graph:   # compile, autotune and create handles outside the capture
            self._graph, self._logits = capture_graph(self._run, 2, pool)

    def _run(self) -> torch.Tensor:
        """The captured work: trunk into the cache, next positions, last-position logits [B, V]."""
        m, cache = self.model, self.cache
        if self.padded:
            valid = self.mask
            n, positions = valid.long().sum(1), token_positions(valid, *valid.shape, None)
        else:
            valid, positions = None, self._positions
            n = torch.full_like(cache.positions, self.length)
        tier = cache.tier if self.rows is None else self.rows
        h = self._trunk(m, self.ids, tier, positions, valid, cache, self._backend, False)
        cache.positions.copy_(n)
        return m.logits_from_hidden(h[:, -1])

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 tiers: list | None = None) -> torch.Tensor:
        """input_ids [B, T] (B <= batch, T <= length; left padding per ``attention_mask``) -> logits [B, V];
        ``tiers``: one ``Tier`` per row (a graph built with ``row_tiers=True``; None: every row at cache.tier)."""
        B, T = input_ids.shape
        if tiers is not None and self.rows is None:
            raise ValueError("this prefill graph runs every row at its cache's tier; build it with row_tiers=True")
        if self.rows is not None:
            self.rows.assign(tiers or [self.cache.tier] * B, self.model.config.value_width)
        L = self.length
        if B > self.cache.batch or T > L or (not self.padded and (T != L or attention_mask is not None)):
            raise ValueError(f"this prefill graph takes up to {self.cache.batch} prompts of "
                             f"{'at most ' if self.padded else 'exactly '}{L} tokens"
                             f"{'' if self.padded else ' without a mask'}; got {tuple(input_ids.shape)}")
        self.ids[:B, L - T:].copy_(input_ids)
        if self.padded:
            self.ids[:B, :L - T].zero_()
            self.mask[:B, :L - T].fill_(False)
            self.mask[:B, L - T:] = True if attention_mask is None else attention_mask.bool()
            self.mask[B:].copy_(self.mask[:1].expand_as(self.mask[B:]))
        self.ids[B:].copy_(self.ids[:1].expand_as(self.ids[B:]))
        if self._graph is not None:
            self._graph.replay()
            return self._logits[:B]
        return self._run()[:B]
