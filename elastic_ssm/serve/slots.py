"""The slot pool: one ``FastDecoder`` of ``slots`` rows at the widest served tier, each row a sequence at any
served tier, with batched, CUDA-graphed prefill and attended spans (docs/serving.md, "Continuous batching")."""

from __future__ import annotations

import logging
import time
import traceback
from collections import OrderedDict
from typing import Any

import torch

from ..elastic.tiers import check_counts
from ..models.cache import ESSHCache
from ..models.compile import GRAPH_TOKENS, PrefillGraph, length_bucket
from ..models.fast_decode import FastDecoder, batch_bucket
from ..ops.dispatch import ENV_VAR
from ..ops.spectral_scan.inputs import sync_free
from ..utils.progress import tuning_notice

__all__ = ["SlotPool", "SlotRows", "row_cache", "reset_row_", "left_pad", "prefill_groups", "served_tiers",
           "GRAPH_TOKENS"]

log = logging.getLogger("elastic_ssm.serve")


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
    return ids.to(device), (None if mask.all() else mask.to(device))


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


def served_tiers(model, tiers: Any) -> list:
    """``tiers`` (one tier, or a list of them) as the model's ``Tier`` objects, narrowest first, without repeats."""
    listed = list(tiers) if isinstance(tiers, (list, tuple)) else [tiers]
    if not listed:
        raise ValueError("a slot pool serves at least one tier")
    return sorted({model.resolve_tier(t) for t in listed}, key=lambda t: t.index)


class SlotPool(SlotRows):
    """``slots`` sequences of ``model`` decoded together, each at one of ``tiers`` (one tier or a list; the
    decoder is built at the widest). ``state_dtype`` / ``kv_dtype``: the cache's (``ESSHCache.allocate``'s
    defaults). ``max_prefill``: the most prompts ``admit_many`` prefills together (rows of its scratch cache).
    ``prefill_graphs``: None = on CUDA; True on the CPU runs the graphs' static-buffer function uncaptured (the CPU
    tests). ``max_graphs``: graphs kept; ``max_graph_tokens``: the most padded tokens of a graph; ``graph_after``:
    the meeting of a shape that captures it (1: at once). ``spans``: attended spans (False: the whole ring every
    step); ``min_span``: the smallest span (a power of two)."""

    #: prompt-length buckets of the graphed prefill: multiples of 32 up to 512 tokens, then at most 1/8 padding
    LENGTH_STEP = 32

    def __init__(self, model, tiers: Any, slots: int, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, max_prefill: int = 16, prefill_graphs: bool | None = None,
                 max_graphs: int = 32, max_graph_tokens: int = GRAPH_TOKENS, graph_after: int = 2, spans: bool = True,
                 min_span: int = 128) -> None:
        if prefill_graphs not in (None, True, False):
            raise ValueError(f"prefill_graphs must be True, False or None (on CUDA), got {prefill_graphs!r}")
        check_counts(slots=slots, max_graphs=max_graphs, max_graph_tokens=max_graph_tokens, graph_after=graph_after)
        super().__init__(slots)
        self.model = model
        self.tiers = served_tiers(model, tiers)
        self.tier = self.tiers[-1]                   # the widest: the decoder's and the cache's
        self.fd = FastDecoder(model, self.tier, slots, state_dtype=state_dtype, kv_dtype=kv_dtype, min_span=min_span,
                              mixed=len(self.tiers) > 1)
        self.device = self.fd.device
        self.spans = bool(spans)
        self.row_pos = [0] * slots                   # tokens each row's sequence holds (host bookkeeping)
        self.graphed = False
        if self.device.type == "cuda":
            start = time.perf_counter()
            self.fd.capture(preserve_cache=False, spans=self.spans)
            self.graphed = True
            spans = "/".join(map(str, self.fd.spans if self.spans else [])) or "none"
            log.info("tiers %s: decode step of %d rows captured in %.1f s (attended spans: %s, and the whole ring)",
                     self._names(), slots, time.perf_counter() - start, spans)
        self.cache = self.fd.cache.reset_()
        V = model.config.vocab_size
        self.logits = torch.zeros(slots, V, dtype=torch.float32, device=self.device)   # [slots, V]
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)         # last token per row
        self.max_prefill = min(slots, max_prefill)
        self._dtypes = (state_dtype, kv_dtype)
        self._scratch: ESSHCache | None = None       # admit_many's prefill cache, allocated on first need
        self._host_tokens: torch.Tensor | None = None  # step_async's pinned copy of the sampled tokens (CUDA)
        self._copied: torch.cuda.Event | None = None
        self.prefill_graphs = self.device.type == "cuda" if prefill_graphs is None else prefill_graphs
        self.max_graphs, self.max_graph_tokens, self.graph_after = max_graphs, max_graph_tokens, graph_after
        self._graphs: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._met: dict[tuple, int] = {}               # times each shape without a graph was met
        self._graph_pool = None                        # one CUDA memory pool for the prefill graphs
        self.captures = 0                              # prefill graphs captured so far
        if self.device.type == "cuda":
            self.warm_up()

    @property
    def row_tier(self) -> list:
        """The tier each row decodes at (the decoder's own record, ``FastDecoder.row_tiers``)."""
        return self.fd.row_tiers

    def _names(self) -> str:
        return "/".join(t.name for t in self.tiers)

    def tier_of(self, tier: Any = None):
        """A served tier (None: the widest) as a ``Tier``; ``ValueError`` for one this pool does not serve."""
        t = self.tier if tier is None else self.model.resolve_tier(tier)
        if t not in self.tiers:
            raise ValueError(f"this pool serves {self._names()}, not {t.name}")
        return t

    @torch.no_grad()
    def warm_up(self, lengths: tuple[int, ...] = (16, 64)) -> None:
        """One prefill per length of ``lengths`` (at the widest tier, as every prefill) into the first free row,
        then that row reset (at construction on CUDA): kernels compile and fla autotunes (chunk length 16 or 64,
        batch no key) while the server starts, not inside its first requests. ``RuntimeError`` without a free row."""
        if not self.free_slots():
            raise RuntimeError("warm_up needs a free slot; call it before admitting requests")
        row = self.owner.index(None)
        start = time.perf_counter()
        tier = [self.tiers[0]] if self.fd.mixed else self.tier     # what _prefill runs: the widest (row factors)
        with tuning_notice(self.device):
            for T in lengths:
                ids = torch.zeros(1, T, dtype=torch.long, device=self.device)                      # [1, T]
                try:
                    self.model.hidden_states(ids, tier=tier, cache=reset_row_(self.cache, row))
                except RuntimeError as e:   # a kernel that fails on this stack: say where, and the way around fla
                    first = (str(e).strip().splitlines() or [""])[0]
                    in_fla = "/fla/" in "".join(traceback.format_exception(e)).replace("\\", "/")   # or a cause
                    around = f"; {ENV_VAR}=torch runs the scan in PyTorch instead" if in_fla else ""
                    raise RuntimeError(f"tier{'s' * self.fd.mixed} {self._names()}: the warm-up prefill of {T} "
                                       f"tokens failed ({type(e).__name__}: {first}){around}") from e
        reset_row_(self.cache, row)
        log.info("tiers %s: prefill warmed up for prompts of %s tokens in %.1f s (on a fresh machine fla autotunes "
                 "here, once; Triton keeps the result on disk)", self._names(), "/".join(map(str, lengths)),
                 time.perf_counter() - start)

    @torch.no_grad()
    def admit(self, owner: Any, prompt: list[int], tier: Any = None) -> int:
        """Prefill ``prompt`` at ``tier`` (None: the widest served) into a free row for ``owner``; its next-token
        logits wait in ``self.logits``."""
        t = self.tier_of(tier)
        if not self.free_slots():
            raise ValueError(f"admit: all {self.slots} slots are busy")
        return self._prefill([owner], [prompt], [t])[0]

    @torch.no_grad()
    def admit_many(self, owners: list, prompts: list[list[int]], tier: Any = None) -> list[int]:
        """Prefill prompts at ``tier`` (one tier, or a list of one per prompt) into free rows in one forward,
        left-padded and masked (every row equals its own prefill up to rounding); returns the rows, in order. ``n``
        consecutive free rows are written in place, else the scratch cache's rows are copied into the first free
        slots."""
        n = len(prompts)
        tiers = [self.tier_of(x) for x in tier] if isinstance(tier, (list, tuple)) else [self.tier_of(tier)] * n
        if len(tiers) != n:
            raise ValueError(f"admit_many: {len(tiers)} tiers for {n} prompts (one tier, or one per prompt)")
        if n == 1:
            return [self.admit(owners[0], prompts[0], tiers[0])]
        if not 1 < n <= min(self.max_prefill, self.free_slots()) or not all(prompts):
            raise ValueError(f"admit_many takes 2..{self.max_prefill} non-empty prompts, at most the "
                             f"{self.free_slots()} free slots")
        return self._prefill(owners, prompts, tiers)

    def _prefill(self, owners: list, prompts: list[list[int]], tiers: list) -> list[int]:
        """``prompts`` prefilled into free rows for ``owners``, row i at ``tiers[i]``: graphed, in place or via
        scratch. A pool of several tiers runs every prefill at its widest tier with per-row factors
        (``elastic/slicing.py``): any mix of tiers is one forward, at one set of kernel shapes and graphs."""
        n, t = len(prompts), self.tier
        per_row = tiers if self.fd.mixed else None
        ids, mask = left_pad(prompts, self.device)                                       # [n, T], [n, T] | None
        graph = self._graph_for(prompts)
        start = None if graph is not None else self.free_run(n)
        if graph is not None:
            logits = graph(ids, mask, per_row)
        else:
            tier = t if per_row is None else self.model.row_tiers(per_row, t)
            view = (self.cache.narrow(n, start=start) if start is not None else self.scratch().narrow(n)).reset_()
            with sync_free():      # as the graphed prefill: no host sync per layer (the CPU stays ahead of the GPU)
                h = self.model.hidden_states(ids, tier=tier, attention_mask=mask, cache=view)   # [n, T, D]
            logits = self.model.logits_from_hidden(h[:, -1])
        if start is not None:
            rows = list(range(start, start + n))
            self.logits[start:start + n] = logits.float()
        else:
            rows = self.free_rows(n)
            self._copy_rows(logits, rows)
        self._own(rows, owners, prompts, tiers)
        return rows

    def _own(self, rows: list[int], owners: list, prompts: list[list[int]], tiers: list) -> None:
        """Rows ``rows`` now hold ``owners``' sequences, row i at ``tiers[i]``: its mode states past K_T zeroed
        (computed at the widest tier, never read; one fill per narrower tier) and the decoder's row factors set."""
        narrower: dict[int, list[int]] = {}
        for i, owner, prompt, tier in zip(rows, owners, prompts, tiers):
            self.owner[i] = owner
            self.row_pos[i] = len(prompt)
            if tier.K < self.tier.K:
                narrower.setdefault(tier.K, []).append(i)
            if self.row_tier[i] != tier:
                self.fd.set_row_tier(i, tier)
        for K, idx in narrower.items():
            idx_t = torch.tensor(idx, device=self.device)
            for s in self.cache.states.values():
                s[:, K:].index_fill_(0, idx_t, 0.0)

    def scratch(self) -> ESSHCache:
        """The prefill cache of ``max_prefill`` rows at the widest tier (allocated on first need)."""
        if self._scratch is None:
            self._scratch = self.model.allocate_cache(self.max_prefill, self.tier, state_dtype=self._dtypes[0],
                                                      kv_dtype=self._dtypes[1])
        return self._scratch

    def _copy_rows(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Rows ``0 .. n-1`` of the scratch cache, and their next-token ``logits [n, V]``, into pool ``rows``."""
        idx = torch.tensor(rows, device=self.device)
        for dst, s in zip(self.cache.tensors(), self.scratch().narrow(len(rows)).tensors()):
            dst.index_copy_(0, idx, s)
        self.logits.index_copy_(0, idx, logits.float())

    def _graph_for(self, prompts: list[list[int]]) -> PrefillGraph | None:
        """The prefill graph at the widest tier for these prompts (in a pool of several tiers: taking one tier per
        row), or None: eager prefill."""
        tier = self.tier
        if not self.prefill_graphs:
            return None
        T = max(len(p) for p in prompts)
        rows = min(batch_bucket(len(prompts)), self.max_prefill)
        length = length_bucket(T, min_step=self.LENGTH_STEP)
        if rows * length > self.max_graph_tokens:
            return None
        key = (tier.name, rows, length, length != T or any(len(p) != T for p in prompts))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        self._met[key] = self._met.get(key, 0) + 1
        if self._met[key] < self.graph_after:
            return None
        del self._met[key]
        cuda = self.device.type == "cuda"
        start = time.perf_counter()
        try:
            if cuda and self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = PrefillGraph(self.model, self.scratch().narrow(rows), length, key[3], graph=cuda,
                                 pool=self._graph_pool, row_tiers=self.fd.mixed)
        except Exception as e:       # e.g. a kernel that cannot be captured: prefill eagerly from now on
            log.warning("tier %s: capturing a prefill graph failed (%s: %s); prefilling without graphs",
                        tier.name, type(e).__name__, e)
            self.prefill_graphs = False
            return None
        self.captures += cuda
        self._graphs[key] = graph
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        if cuda:
            log.info("tier %s: prefill graph for %d rows x %d tokens%s captured in %.1f s", tier.name, rows,
                     length, " (padded)" if key[3] else "", time.perf_counter() - start)
        return graph

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (tokens [slots]); the next logits [slots, V] land in ``self.logits``. The
        step attends over the span of the longest running row."""
        self.tokens.copy_(tokens)
        active = self.active_rows()
        span = max(self.row_pos[r] for r in active) + 1 if self.spans and active else None
        self.logits.copy_(self.fd.step(self.tokens, span=span))
        for r in active:
            self.row_pos[r] += 1
        return self.logits

    @torch.no_grad()
    def step_async(self, tokens: torch.Tensor) -> list[int]:
        """Launch :meth:`step` on ``tokens [slots]`` and return them as host ints without waiting for the step
        (on CUDA a pinned copy queued before it), so the caller works while the GPU computes the next logits."""
        if self.device.type != "cuda":
            values = tokens.tolist()
            self.step(tokens)
            return values
        if self._host_tokens is None:
            self._host_tokens = torch.empty(self.slots, dtype=torch.long, pin_memory=True)
            self._copied = torch.cuda.Event(blocking=True)      # the wait sleeps, not spins a core for the step
        self._host_tokens.copy_(tokens, non_blocking=True)
        self._copied.record()
        self.step(tokens)
        self._copied.synchronize()
        return self._host_tokens.tolist()
