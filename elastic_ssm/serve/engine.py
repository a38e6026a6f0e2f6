"""The serving engine: continuous batching of every served tier in one ``SlotPool``, in a background thread, with
coalescing admission (docs/serving.md, "Continuous batching"); a served ``Request``, whose events reach their event
loop through ``deliver`` in one thread-safe call per loop. A failing request ends alone; the engine keeps serving."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..elastic.tiers import check_counts
from .slots import GRAPH_TOKENS, SlotPool, prefill_groups
from .tokens import RowNoise, TextStream, sample_rows

__all__ = ["Engine", "Request", "Busy", "deliver", "PREFILL_WAIT_MS", "PREFILL_GAP_MS", "PREFILL_TOKENS", "COUNTERS"]

log = logging.getLogger("elastic_ssm.serve")

#: default of ``--max_prefill_tokens``: prompt tokens (padding included) in one prefill forward
PREFILL_TOKENS = 32768

#: ``Engine.counters()``: name -> what it counts, as ``/metrics`` reports them (``elastic_ssm_<name>_total``)
COUNTERS = {
    "decode_steps": "Decode steps run by the engine",
    "prefill_forwards": "Prefill forwards run (prompts admitted together: one)",
    "prefill_graph_captures": "Prefill CUDA graphs captured (--prefill_graphs)",
    "idle_seconds": "Seconds the engine loop waited with nothing to run",
    "prefill_seconds": "Seconds the engine loop spent admitting requests (host wall clock)",
}

#: default of ``--prefill_wait_ms``; a pause in arrivals that admits sooner (docs/serving.md, "Coalescing admission")
PREFILL_WAIT_MS, PREFILL_GAP_MS = 150.0, 10.0

_ids = itertools.count(1)
_OUTBOX: dict[Any, list] = {}     # event loop -> [(queue, event)], filled and flushed by the engine thread only


def _put_all(items: list) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def deliver() -> None:
    """Hand every queued event to its event loop: one ``call_soon_threadsafe`` per loop."""
    while _OUTBOX:
        loop, items = _OUTBOX.popitem()
        if not loop.is_closed():
            loop.call_soon_threadsafe(_put_all, items)


def check_options(max_prefill: int = 16, max_prefill_tokens: int = PREFILL_TOKENS,
                  prefill_graph_tokens: int = GRAPH_TOKENS, prefill_wait_ms: float = PREFILL_WAIT_MS, **_: Any) -> None:
    """ValueError naming the first of ``Engine``'s admission options out of range (ints >= 1, a finite wait >= 0)."""
    check_counts(max_prefill=max_prefill, max_prefill_tokens=max_prefill_tokens,
                 prefill_graph_tokens=prefill_graph_tokens)
    ms = prefill_wait_ms
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise ValueError(f"prefill_wait_ms must be a finite number of milliseconds >= 0 (0: admit at once), "
                         f"got {ms!r}")


class Busy(RuntimeError):
    """Every slot is busy and the queue is full (the HTTP layer answers 503)."""


@dataclass
class Request:
    """One completion: token ids of the prompt, sampling parameters, and the way back to its client."""

    tier: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    loop: Any = None                 # the asyncio loop of the handler (None: events are only recorded)
    queue: Any = None                # asyncio.Queue the handler reads
    id: str = field(default_factory=lambda: f"cmpl-{next(_ids)}")
    created: float = field(default_factory=time.time)
    completion_tokens: int = 0
    tokens: list[int] = field(default_factory=list)             # the generated token ids
    finish_reason: str | None = None
    first_token_at: float | None = None
    cancelled: bool = False
    role_sent: bool = False          # a streamed chat answer has named its role
    consumed_at: float = field(default_factory=time.monotonic)   # the handler last took an event
    emitted: int = 0                 # events emitted (engine thread only)
    taken: int = 0                   # events taken (handler side only)
    rid: int = 0                     # the request's number between the processes of ``RemoteEngine``
    queued_at: float = 0.0           # when ``Engine.submit`` queued it (the engine's clock)
    on_cancel: Any = None            # called once by ``cancel`` (``RemoteEngine`` tells its engine process)

    @property
    def pending(self) -> int:
        """Events emitted and not yet taken by the handler."""
        return self.emitted - self.taken

    def emit(self, *event: Any) -> None:
        """Queue ``event`` for the handler (delivered by the engine at the end of its step)."""
        self.emitted += 1
        if self.loop is not None:
            _OUTBOX.setdefault(self.loop, []).append((self.queue, event))

    def took(self) -> None:
        """The handler took one event (called on its side; used to detect a client that stopped reading)."""
        self.taken += 1
        self.consumed_at = time.monotonic()

    def cancel(self) -> None:
        if not self.cancelled and self.on_cancel is not None:
            self.on_cancel(self)
        self.cancelled = True

    def cancel_if_stalled(self, now: float, timeout: float) -> bool:
        """Cancel the request when its client has left pending output untaken for over ``timeout`` s (one warning);
        whether it is cancelled."""
        if not self.cancelled and self.pending > 0 and now - self.consumed_at > timeout:
            log.warning("%s: client stopped reading for %.0f s; cancelled", self.id, timeout)
            self.cancel()
        return self.cancelled


class Engine:
    """Continuous batching of every served tier in one ``SlotPool``.

    ``slots``: rows of the pool, shared by every tier. ``max_queue``: waiting requests before ``Busy``.
    ``stall_timeout``: seconds a request may hold undelivered output before it is cancelled. ``eos``: token id
    that ends a request (None: none). ``max_prefill`` / ``max_prefill_tokens``: the most prompts / padded prompt
    tokens in one prefill forward (a longer prompt goes alone). ``prefill_wait_ms``: the longest a waiting request
    is held for more arrivals (0: at once; sooner once they pause ``PREFILL_GAP_MS``). ``prefill_graphs``:
    CUDA-graphed prefill on CUDA, each of at most ``prefill_graph_tokens`` padded tokens. ``attended_spans``:
    ``SlotPool``'s ``spans``. ``pool_factory``: internal (the bench's CPU ``StubPool``), called as ``SlotPool`` is.
    ``clock``: the monotonic clock in seconds that admission reads (tests inject one)."""

    def __init__(self, model, tiers: list[str], slots: int = 8, max_queue: int = 64, stall_timeout: float = 30.0,
                 eos: int | None = None, tokenizer=None, pool_factory=SlotPool,
                 max_prefill: int = 16, prefill_wait_ms: float = PREFILL_WAIT_MS, clock=time.monotonic,
                 max_prefill_tokens: int = PREFILL_TOKENS, prefill_graphs: bool = True,
                 attended_spans: bool = True, prefill_graph_tokens: int = GRAPH_TOKENS) -> None:
        check_options(max_prefill, max_prefill_tokens, prefill_graph_tokens, prefill_wait_ms)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_wait, self._clock = prefill_wait_ms / 1e3, clock
        self.model, self.tokenizer = model, tokenizer
        self.eos, self.max_queue, self.stall_timeout = eos, max_queue, stall_timeout
        self.tiers = [model.resolve_tier(t).name for t in tiers]
        self.pool = pool_factory(model, self.tiers, slots, max_prefill=max_prefill,
                                 prefill_graphs=None if prefill_graphs else False, spans=attended_spans,
                                 max_graph_tokens=prefill_graph_tokens)
        dev, V = self.pool.device, model.config.vocab_size
        self._noise = RowNoise(slots, V, dev)
        self._params = (torch.zeros(slots, device=dev), torch.zeros(slots, dtype=torch.long, device=dev),
                        torch.ones(slots, device=dev))
        self._texts: list[TextStream | None] = [None] * slots
        self.waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="elastic-ssm-engine", daemon=True)
        # COUNTERS but the captures, which the pool counts (a decode step: one, whatever the tiers)
        self.count = {key: 0 for key in COUNTERS if key != "prefill_graph_captures"}
        self.generated: Counter[str] = Counter()      # tokens generated per tier (/metrics reads it when scraped)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request) -> None:
        """Queue ``req`` at its tier; ``Busy`` when every slot is busy and the queue is full."""
        if self._thread.ident is not None and not self._thread.is_alive():
            raise Busy("the server's engine has stopped; restart the server")
        if req.tier not in self.tiers:
            raise ValueError(f"tier {req.tier} is not served here (served: {', '.join(self.tiers)})")
        with self._cond:
            if len(self.waiting) >= self.max_queue + self.pool.free_slots():
                raise Busy(f"the server is at capacity ({self.pool.slots} slots busy, {len(self.waiting)} requests "
                           "waiting); retry shortly")
            req.queued_at = self._clock()
            self.waiting.append(req)
            self._cond.notify_all()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per tier: the pool's slots (shared by every tier), the rows busy at that tier, its waiting requests."""
        busy = Counter(self.pool.row_tier[r].name for r in self.pool.active_rows())
        waiting = Counter(r.tier for r in self.waiting)
        return {n: {"slots": self.pool.slots, "busy": busy[n], "waiting": waiting[n]} for n in self.tiers}

    def counters(self) -> dict[str, float]:
        """The loop's ``COUNTERS`` so far, as ``/metrics`` reports them (admission time is host wall clock)."""
        return {**{k: round(v, 6) for k, v in self.count.items()},
                "prefill_graph_captures": getattr(self.pool, "captures", 0)}

    def _admit_in(self, now: float) -> float | None:
        """Seconds until the waiting requests should be prefilled (0: now; None: none wait, or no slot is free)."""
        q = self.waiting
        free = self.pool.free_slots() if q else 0
        if not free:
            return None
        if self.prefill_wait <= 0 or len(q) >= min(self.pool.max_prefill, free):
            return 0.0
        return max(0.0, min(q[0].queued_at + self.prefill_wait, q[-1].queued_at + PREFILL_GAP_MS / 1e3) - now)

    def _idle_for(self) -> float | None:
        """Seconds the loop may sleep (0: the pool has running rows or an admission is due; None: until notified)."""
        return 0.0 if self.pool.busy() else self._admit_in(self._clock())

    def _run(self) -> None:
        while True:
            with self._cond:
                start = time.monotonic()
                while not self._stop and (wait := self._idle_for()) != 0:
                    self._cond.wait(timeout=1.0 if wait is None else min(wait, 1.0))
                self.count["idle_seconds"] += time.monotonic() - start
                if self._stop:
                    return
            try:
                self._tick()
            except Exception as e:   # a failure of the step itself: end the running requests, keep serving
                log.exception("engine step failed")
                try:
                    for row in self.pool.active_rows():
                        self._finish(row, "error", f"internal error while decoding: {type(e).__name__}")
                except Exception:
                    log.exception("could not end the running requests; freeing their slots")
                    self.pool.owner = [None] * self.pool.slots
            deliver()

    def _finish(self, row: int, reason: str, error: str | None = None) -> None:
        """End the request of ``row`` (``error``: with an ``error`` event, its text left unsent) and free the row."""
        req, text = self.pool.owner[row], self._texts[row]
        if error is None and reason != "cancelled" and text is not None and (tail := text.finish()):
            req.emit("text", tail)
        req.finish_reason = reason
        req.emit(*(("done", reason) if error is None else ("error", error)))
        self.pool.release(row)
        self._texts[row] = None
        self._noise.seed_row(row, None)

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, oldest first, in groups of similar length whatever their tiers
        (the pool prefills a mix of tiers in one forward); a group whose prefill fails is prefilled one by one, so
        only a failing request ends."""
        pool, q = self.pool, self.waiting
        take: list[Request] = []
        with self._cond:
            while q and len(take) < pool.free_slots():
                take.append(q.popleft())           # one cancelled meanwhile ends at the next step, as a running row
        for group in prefill_groups([len(r.prompt) for r in take], pool.max_prefill, self.max_prefill_tokens):
            self._admit_group([take[i] for i in group])

    def _admit_group(self, chunk: list[Request]) -> None:
        try:
            rows = (self.pool.admit_many(chunk, [r.prompt for r in chunk], [r.tier for r in chunk])
                    if len(chunk) > 1 else None)
            self.count["prefill_forwards"] += rows is not None
        except Exception as e:
            log.warning("batched prefill of %d prompts failed (%s); prefilling them one by one", len(chunk), e)
            rows = None
        if rows is None:
            rows = [self._admit_one(req) for req in chunk]
            self.count["prefill_forwards"] += len(chunk)
        for req, row in zip(chunk, rows):
            if row is not None:
                self._start(req, row)

    def _admit_one(self, req: Request) -> int | None:
        """Prefill one request; a failure ends that request (an ``error`` event) and returns None."""
        try:
            return self.pool.admit(req, req.prompt, req.tier)
        except Exception as e:
            log.warning("prefill of %s failed: %s", req.id, e)
            req.finish_reason = "error"
            req.emit("error", f"the prompt could not be processed: {e}")
            return None

    def _start(self, req: Request, row: int) -> None:
        temp, top_k, top_p = self._params
        req.consumed_at = time.monotonic()     # time in the queue is not time the client failed to read
        temp[row], top_k[row], top_p[row] = float(req.temperature), int(req.top_k), float(req.top_p)
        self._noise.seed_row(row, req.seed)
        self._texts[row] = TextStream(self.tokenizer, req.stop)
        if req.max_tokens == 0:
            self._finish(row, "length")

    def _tick(self) -> None:
        pool = self.pool
        now = time.monotonic()
        for row in pool.active_rows():
            if pool.owner[row].cancel_if_stalled(now, self.stall_timeout):
                self._finish(row, "cancelled")
        with self._cond:            # a waiting request whose client left gives its place in the queue back now
            gone = [r for r in self.waiting if r.cancelled]
            for req in gone:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                req.emit("done", "cancelled")
        if self._admit_in(self._clock()) == 0:
            start = time.monotonic()
            self._admit()
            self.count["prefill_seconds"] += time.monotonic() - start
        rows = pool.active_rows()
        if not rows:
            return
        temp, top_k, top_p = self._params
        reqs = [pool.owner[r] for r in rows]
        sampling = any(r.temperature > 0 for r in reqs)
        filters = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in reqs)
        noise = self._noise.draw() if sampling else None
        tokens = sample_rows(pool.logits, temp, top_k, top_p, noise, filters)          # [slots]
        values = pool.step_async(tokens)      # the per-row work below overlaps the step on the device
        t = time.monotonic()
        for row, req in zip(rows, reqs):
            tok = values[row]
            req.completion_tokens += 1
            req.tokens.append(tok)
            if req.first_token_at is None:
                req.first_token_at = t
            if self.eos is not None and tok == self.eos:
                self._finish(row, "stop")
                continue
            stream = self._texts[row]
            if piece := stream.push(tok):
                req.emit("text", piece)
            if stream.stopped:
                self._finish(row, "stop")
            elif req.completion_tokens >= req.max_tokens:
                self._finish(row, "length")
        self.generated.update(r.tier for r in reqs)
        self.count["decode_steps"] += 1
