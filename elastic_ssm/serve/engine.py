"""The serving engine: continuous batching over one slot pool per served tier, in one background thread.

``Engine(model, tiers, slots)`` builds a ``SlotPool`` per tier (``serve/slots.py``; the weights are the one
loaded model's prefix views, only caches and graphs are per tier). ``submit(request)`` queues a
``Request`` for its tier (bounded: ``max_queue`` waiting per tier, then ``Busy``). The engine thread
loops: for each tier it drops cancelled or stalled requests (freeing their slots at once), prefills
waiting requests into free slots (coalescing a burst of arrivals, below), samples one token for every busy
row (``serve/tokens.py``, per-row parameters), launches the pool's decode step on those tokens (its fixed
batch bucket) and, while the GPU runs it, hands each request its text (``serve/tokens.py``). A request
finishes on ``max_tokens`` (reason ``length``), on a stop string or the model's eos token (``stop``), or by
cancellation (the client left or stopped reading).

Events reach the HTTP side through ``Request.emit``: ``("text", str)``, ``("done", finish_reason)``,
``("error", message)``, and ``("unavailable", message)`` when the request could not run and may be retried (the
engine process ended, or was full when it arrived: ``serve/remote.py``; a 503). The engine collects the events
of a whole step and hands them to the event loop in one thread-safe call per loop (``deliver``), not one per
token, so 128 streams cost one wake-up a step.
An error while serving one request ends that request only; the engine keeps serving the others.

Coalescing admission (``prefill_wait_ms``, a dynamic batcher's maximum queue delay, as Triton's
``max_queue_delay_microseconds``; the preferred batch is what can be admitted now): a prefill forward has a fixed
cost besides its per-token cost (the 1.5b at T10, 128-token prompts, H200: ~74 ms + ~11.7 us a token), so a burst
of 128 arrivals costs far less in one forward than in the many small ones that admitting "whatever is queued
when the loop comes round" gives. A tier's waiting requests are prefilled when they fill
``min(max_prefill, free slots)``, or when the oldest of them has waited ``prefill_wait_ms`` since it reached the
engine; until then the running rows keep decoding (the queue is checked between steps) and, with no row running,
the engine sleeps on its condition variable until a new arrival or that deadline. 0 admits at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .slots import GRAPH_TOKENS, SlotPool, prefill_groups
from .tokens import RowNoise, TextStream, sample_rows

__all__ = ["Engine", "Request", "Busy", "PREFILL_WAIT_MS", "PREFILL_TOKENS", "COUNTERS", "check_prefill_wait"]

log = logging.getLogger("elastic_ssm.serve")
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

#: default of ``--prefill_wait_ms`` (docs/serving.md, "Coalescing admission", has the measurements behind it)
PREFILL_WAIT_MS = 50.0


def check_prefill_wait(ms) -> None:
    """ValueError unless ``ms`` is a finite number of milliseconds >= 0."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise ValueError(f"prefill_wait_ms must be a finite number of milliseconds >= 0 (0: admit at once), "
                         f"got {ms!r}")


class Busy(RuntimeError):
    """Every slot of the tier is busy and its queue is full (the HTTP layer answers 503)."""


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


class Engine:
    """Continuous batching over one ``SlotPool`` per tier (see the module docstring).

    ``slots``: rows per tier pool (the decoder's batch bucket). ``max_queue``: waiting requests per tier
    before ``Busy``. ``stall_timeout``: seconds a request may hold undelivered output before it is
    cancelled and its slot freed. ``eos``: token id that ends a request (None: none). ``max_prefill``: the most
    waiting prompts prefilled together in one forward (``SlotPool.admit_many``, similar lengths left-padded; a
    burst of arrivals is admitted in fewer, larger forwards when it is larger); ``max_prefill_tokens``: the most
    prompt tokens, padding included, in one of them (a longer prompt goes alone). ``prefill_wait_ms``: the longest a
    waiting request is held for more arrivals to share its prefill forward (module docstring; 0: admit at once).
    ``prefill_graphs``: False prefills eagerly; True (default) replays prefill forwards from CUDA graphs on CUDA
    (``SlotPool``, ``serve/slots.py``; the CPU always prefills eagerly), each of at most ``prefill_graph_tokens``
    padded prompt tokens (larger ones run eagerly). ``pool_factory``: internal (the bench's
    CPU proxy, ``bench/serve_stub.py``'s ``StubPool``): builds each tier's pool as ``pool_factory(model, tier, slots,
    max_prefill=..., prefill_graphs=..., spans=...)``; ``SlotPool`` everywhere else. ``attended_spans``: decode
    steps read only the filled prefix of the window rings while every running sequence is short (``SlotPool``).
    ``clock``: the monotonic clock, in seconds, that admission reads (tests inject a fake one).
    """

    def __init__(self, model, tiers: list[str], slots: int = 8, max_queue: int = 64, stall_timeout: float = 30.0,
                 eos: int | None = None, tokenizer=None, metrics=None, pool_factory=SlotPool,
                 max_prefill: int = 16, prefill_wait_ms: float = PREFILL_WAIT_MS, clock=time.monotonic,
                 max_prefill_tokens: int = PREFILL_TOKENS, prefill_graphs: bool = True,
                 attended_spans: bool = True, prefill_graph_tokens: int = GRAPH_TOKENS) -> None:
        for key, value in (("max_prefill", max_prefill), ("max_prefill_tokens", max_prefill_tokens),
                           ("prefill_graph_tokens", prefill_graph_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        self.max_prefill_tokens = max_prefill_tokens
        check_prefill_wait(prefill_wait_ms)
        self.prefill_wait, self._clock = prefill_wait_ms / 1e3, clock
        self.model, self.tokenizer, self.metrics = model, tokenizer, metrics
        self.eos, self.max_queue, self.stall_timeout = eos, max_queue, stall_timeout
        self.pools: dict[str, SlotPool] = {}
        for name in tiers:
            self.pools[name] = pool_factory(model, name, slots, max_prefill=max_prefill,
                                            prefill_graphs=None if prefill_graphs else False,
                                            spans=attended_spans, max_graph_tokens=prefill_graph_tokens)
        V = model.config.vocab_size
        self._noise = {name: RowNoise(slots, V, p.device) for name, p in self.pools.items()}
        self._params = {name: (torch.zeros(slots, device=p.device), torch.zeros(slots, dtype=torch.long,
                        device=p.device), torch.ones(slots, device=p.device)) for name, p in self.pools.items()}
        self._texts: dict[str, list[TextStream | None]] = {n: [None] * slots for n in self.pools}
        self.waiting: dict[str, deque[Request]] = {n: deque() for n in self.pools}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="elastic-ssm-engine", daemon=True)
        self.steps = 0                  # decode steps run
        self.prefills = 0               # prefill forwards run (a batched one counts once)
        self.idle_s = 0.0               # seconds the loop waited with nothing to run
        self.prefill_s = 0.0            # seconds the loop spent admitting (prefill forwards, host wall clock)

    # ---- control -----------------------------------------------------------------------------------------
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
        """Queue ``req`` for its tier; ``Busy`` when the tier's queue is full."""
        if self._thread.ident is not None and not self._thread.is_alive():
            raise Busy("the server's engine has stopped; restart the server")
        with self._cond:
            q = self.waiting[req.tier]
            if len(q) >= self.max_queue + self.pools[req.tier].free_slots():
                raise Busy(f"tier {req.tier} is at capacity ({self.pools[req.tier].slots} slots busy, "
                           f"{len(q)} requests waiting); retry shortly")
            req.queued_at = self._clock()
            q.append(req)
            self._cond.notify_all()

    def load(self, tier: str) -> float:
        """Busy slots plus waiting requests, per slot (> 1: requests wait)."""
        p = self.pools[tier]
        return (p.busy() + len(self.waiting[tier])) / p.slots

    def pick_auto(self, default: str) -> str:
        """``"tier": "auto"`` under load: the largest served tier up to ``default`` with a slot free for one more
        request, else the least loaded of them."""
        order = {t.name: t.index for t in self.model.tier_table()}
        cands = sorted((t for t in self.pools if order[t] <= order[default]), key=lambda t: -order[t])
        for t in cands:
            if self.pools[t].free_slots() > len(self.waiting[t]):
                return t
        return min(cands, key=self.load)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {n: {"slots": p.slots, "busy": p.busy(), "waiting": len(self.waiting[n])}
                for n, p in self.pools.items()}

    @property
    def captures(self) -> int:
        """Prefill graphs captured so far by the pools (``SlotPool.captures``)."""
        return sum(getattr(p, "captures", 0) for p in self.pools.values())

    def counters(self) -> dict[str, float]:
        """What ``/metrics`` reports of the loop so far: decode steps, prefill forwards, prefill graph captures,
        seconds idle and seconds admitting. Admission time is host wall clock: a synchronous prefill (the torch
        scan reads its plan on the host) counts whole, the device time left of an asynchronous one goes to the
        next decode step. Wall time minus both is decoding (and the per-row work between steps)."""
        return {"decode_steps": self.steps, "prefill_forwards": self.prefills,
                "prefill_graph_captures": self.captures, "idle_seconds": round(self.idle_s, 6),
                "prefill_seconds": round(self.prefill_s, 6)}

    # ---- the loop ----------------------------------------------------------------------------------------
    def _admit_in(self, name: str, now: float) -> float | None:
        """Seconds until tier ``name`` should prefill its waiting requests (0: now; None: none wait, or no slot is
        free): at once when they fill ``min(max_prefill, free slots)`` or coalescing is off, else when the oldest
        has waited ``prefill_wait``."""
        q, pool = self.waiting[name], self.pools[name]
        if not q:
            return None
        free = pool.free_slots()
        if free == 0:
            return None
        if self.prefill_wait <= 0 or len(q) >= min(pool.max_prefill, free):
            return 0.0
        return max(0.0, q[0].queued_at + self.prefill_wait - now)

    def _idle_for(self) -> float | None:
        """Seconds the loop may sleep (0: a pool has running rows or an admission is due; None: until notified)."""
        if any(p.busy() for p in self.pools.values()):
            return 0.0
        now = self._clock()
        due = [d for d in (self._admit_in(n, now) for n in self.pools) if d is not None]
        return min(due, default=None)

    def _run(self) -> None:
        while True:
            with self._cond:
                start = time.monotonic()
                while not self._stop and (wait := self._idle_for()) != 0:
                    self._cond.wait(timeout=1.0 if wait is None else min(wait, 1.0))
                self.idle_s += time.monotonic() - start
                if self._stop:
                    return
            for name in self.pools:
                try:
                    self._tick(name)
                except Exception as e:   # a failure of the step itself: end this pool's requests, keep serving
                    log.exception("engine step failed at tier %s", name)
                    try:
                        self._fail_all(name, f"internal error while decoding: {type(e).__name__}")
                    except Exception:
                        log.exception("could not end the requests of tier %s; freeing its slots", name)
                        self.pools[name].owner = [None] * self.pools[name].slots
                deliver()

    def _finish(self, name: str, row: int, reason: str) -> None:
        pool = self.pools[name]
        req = pool.owner[row]
        text = self._texts[name][row]
        if reason != "cancelled" and text is not None:
            tail = text.finish()
            if tail:
                req.emit("text", tail)
        req.finish_reason = reason
        req.emit("done", reason)
        pool.release(row)
        self._texts[name][row] = None
        self._noise[name].seed_row(row, None)

    def _fail_all(self, name: str, message: str) -> None:
        pool = self.pools[name]
        for row in pool.active_rows():
            pool.owner[row].finish_reason = "error"
            pool.owner[row].emit("error", message)
            pool.release(row)
            self._texts[name][row] = None

    def _admit(self, name: str) -> None:
        """Prefill waiting requests into free rows, in groups of similar length (``prefill_groups``; one batched,
        left-padded forward each, ``SlotPool.admit_many``); a group whose prefill fails is prefilled one by one,
        so only a failing request ends."""
        pool, q = self.pools[name], self.waiting[name]
        take: list[Request] = []
        with self._cond:
            while q and len(take) < pool.free_slots():
                req = q.popleft()
                if req.cancelled:
                    req.finish_reason = "cancelled"
                    req.emit("done", "cancelled")
                else:
                    take.append(req)
        for group in prefill_groups([len(r.prompt) for r in take], pool.max_prefill, self.max_prefill_tokens):
            chunk = [take[i] for i in group]
            try:
                rows = pool.admit_many(chunk, [r.prompt for r in chunk]) if len(chunk) > 1 else None
                self.prefills += rows is not None
            except Exception as e:
                log.warning("batched prefill of %d prompts failed (%s); prefilling them one by one", len(chunk), e)
                rows = None
            if rows is None:
                rows = [self._admit_one(pool, req) for req in chunk]
                self.prefills += len(chunk)
            for req, row in zip(chunk, rows):
                if row is not None:
                    self._start(name, req, row)

    @staticmethod
    def _admit_one(pool: SlotPool, req: Request) -> int | None:
        """Prefill one request; a failure ends that request (an ``error`` event) and returns None."""
        try:
            return pool.admit(req, req.prompt)
        except Exception as e:
            log.warning("prefill of %s failed: %s", req.id, e)
            req.finish_reason = "error"
            req.emit("error", f"the prompt could not be processed: {e}")
            return None

    def _start(self, name: str, req: Request, row: int) -> None:
        temp, top_k, top_p = self._params[name]
        req.consumed_at = time.monotonic()     # time in the queue is not time the client failed to read
        temp[row], top_k[row], top_p[row] = float(req.temperature), int(req.top_k), float(req.top_p)
        self._noise[name].seed_row(row, req.seed)
        self._texts[name][row] = TextStream(self.tokenizer, req.stop)
        if req.max_tokens == 0:
            self._finish(name, row, "length")

    def _tick(self, name: str) -> None:
        pool = self.pools[name]
        now = time.monotonic()
        for row in pool.active_rows():
            req = pool.owner[row]
            if req.cancelled or (req.pending > 0 and now - req.consumed_at > self.stall_timeout):
                if not req.cancelled:
                    log.warning("%s: client stopped reading for %.0f s; cancelled", req.id, self.stall_timeout)
                    req.cancel()
                self._finish(name, row, "cancelled")
        if self._admit_in(name, self._clock()) == 0:
            start = time.monotonic()
            self._admit(name)
            self.prefill_s += time.monotonic() - start
        rows = pool.active_rows()
        if not rows:
            return
        temp, top_k, top_p = self._params[name]
        reqs = [pool.owner[r] for r in rows]
        sampling = any(r.temperature > 0 for r in reqs)
        filters = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in reqs)
        noise = self._noise[name].draw() if sampling else None
        tokens = sample_rows(pool.logits, temp, top_k, top_p, noise, filters)          # [slots]
        # the tokens go to the host while the GPU already runs the next step on them: the per-row work below
        # (text, stop strings, events) overlaps the step instead of adding to every inter-token gap. A row
        # that finishes here has been stepped once more; its slot is reset when next admitted.
        values = pool.step_async(tokens)
        t = time.monotonic()
        for row, req in zip(rows, reqs):
            tok = values[row]
            req.completion_tokens += 1
            req.tokens.append(tok)
            if req.first_token_at is None:
                req.first_token_at = t
            if self.eos is not None and tok == self.eos:
                self._finish(name, row, "stop")
                continue
            stream = self._texts[name][row]
            piece = stream.push(tok)
            if piece:
                req.emit("text", piece)
            if stream.stopped:
                self._finish(name, row, "stop")
            elif req.completion_tokens >= req.max_tokens:
                self._finish(name, row, "length")
        if self.metrics is not None:
            self.metrics.add_tokens(name, len(rows))
        self.steps += 1
