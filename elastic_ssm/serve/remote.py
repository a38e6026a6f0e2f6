"""The engine in its own process (``RemoteEngine``): the HTTP process only parses requests and streams events
(docs/serving.md, "Two processes"). One pipe each way: HTTP -> engine ``("submit", rid, fields)``, ``("cancel",
rid)``, ``("stop",)``; engine -> HTTP ``("ready",)`` or ``("failed", message)``, then per step ``("ev", counters,
{tier: tokens generated}, {tier: busy}, [(rid, kind, value, completion_tokens, first_token_at), ...])``, and
``("stopped", "SIGTERM")``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import math
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizers import resolve_tokenizer
from ..models import saved_model_class
from ..models.model_dir import _saved_tokenizer
from .engine import COUNTERS, Busy, Engine, Request, check_options

__all__ = ["RemoteEngine", "model_view"]

log = logging.getLogger("elastic_ssm.serve")
_FIELDS = ("tier", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


class _Sink:
    """The engine's asyncio loop in ``deliver``: one message per call to the HTTP process."""

    def __init__(self, conn, live: dict) -> None:
        self.conn, self.live, self.engine = conn, live, None

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, _fn, items: list) -> None:
        out = []
        for req, (kind, value) in items:        # queue = the engine-side Request itself
            out.append((req.rid, kind, value, req.completion_tokens, req.first_token_at))
            if kind in ("done", "error", "unavailable"):
                self.live.pop(req.rid, None)
        busy = {t: v["busy"] for t, v in self.engine.snapshot().items()}
        self.conn.send(("ev", self.engine.counters(), dict(self.engine.generated), busy, out))


class _Stop(BaseException):
    """Raised in the engine process by SIGTERM (not an ``Exception``: no handler on the way mistakes it for one)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)       # a second one must not interrupt the shutdown
    raise _Stop


def _child(load: Callable[[], Any], kw: dict, commands, events) -> None:
    """The engine process: load the model, run ``Engine``, follow the HTTP process's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    engine = None
    live: dict[int, Request] = {}
    sink = _Sink(events, live)
    try:
        try:
            engine = sink.engine = Engine(load(), stall_timeout=math.inf, **kw)
        except Exception as e:
            events.send(("failed", f"{type(e).__name__}: {e}"))
            return
        gc.freeze()     # out of the collector's sight: a full collection stalled every stream
        engine.start()
        events.send(("ready",))
        while True:
            msg = commands.recv()
            if msg[0] == "submit":
                req = Request(**msg[2], loop=sink)
                req.rid, req.queue = msg[1], req
                live[req.rid] = req
                try:
                    engine.submit(req)
                except Busy as e:                 # full since the HTTP side counted: retry, as there
                    req.finish_reason = "error"
                    req.emit("unavailable", str(e))
            elif msg[0] == "cancel":
                if (req := live.get(msg[1])) is not None:
                    req.cancel()
            elif msg[0] == "stop":
                break
    except _Stop:
        with contextlib.suppress(OSError):      # the HTTP process may be gone already
            events.send(("stopped", "SIGTERM"))
    except (EOFError, OSError):      # the HTTP process is gone
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if engine is not None:
            engine.shutdown()


def model_view(path: str) -> Any:
    """A saved model on the meta device with its tokenizer (``CheckpointError`` as ``load_pretrained``)."""
    cls = saved_model_class(path)
    config, meta = cls.read_config(path)
    with torch.device("meta"):
        model = cls(config)
    model.name_or_path = str(path)
    model.source = dict(meta.get("source") or {})      # an older export answers to its source tier's name
    model.tokenizer_record = meta.get("tokenizer")
    model.tokenizer = _saved_tokenizer(Path(path), model.tokenizer_record)
    return model


class RemoteEngine:
    """``Engine``'s interface to the HTTP app, its decode loop in a child process: ``load`` (picklable) builds the
    model there, ``model`` is this side's view of it (``model_view``); the others are ``Engine``'s (picklable)."""

    def __init__(self, load: Callable[[], Any], model, tiers: list[str], slots: int = 8, max_queue: int = 64,
                 stall_timeout: float = 30.0, start_timeout: float = 1800.0, tokenizer=None,
                 **engine_options: Any) -> None:
        inspect.signature(Engine).bind_partial(**engine_options)   # in this process: an unknown name or a bad
        check_options(**engine_options)                           # value fails before the child starts
        self.model, self.tiers, self.slots, self.max_queue = model, list(tiers), slots, max_queue
        self.stall_timeout, self.start_timeout = stall_timeout, start_timeout
        kw: dict[str, Any] = {"tiers": self.tiers, "slots": slots, "max_queue": max_queue, **engine_options,
                              "tokenizer": tokenizer if tokenizer is not None else resolve_tokenizer(model)}
        ctx = mp.get_context("spawn")
        self._cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._ev, self._ev_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(load, kw, self._cmd_r, self._ev_w), daemon=True,
                                 name="elastic-ssm-engine")
        self.live: dict[int, Request] = {}
        self.in_flight: dict[str, int] = {t: 0 for t in self.tiers}
        self._busy: dict[str, int] = {}   # rows busy per tier, as of the engine's last message
        self._counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)   # the engine's, as of its last message
        self.generated: dict[str, int] = {}                             # its tokens per tier, as of that message
        self._next_rid = 0
        self._dead = False
        self._stopped = False             # shutdown() ran, or the engine said it stopped: said once, as info
        self._loop = None
        self._watch = None

    def start(self) -> RemoteEngine:
        """Start the child and wait until its pools are built (idempotent); ``RuntimeError`` if it fails."""
        if self._proc.pid is not None:
            return self
        self._proc.start()
        self._cmd_r.close()
        self._ev_w.close()
        if not self._ev.poll(self.start_timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {self.start_timeout:g} s")
        try:
            msg = self._ev.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process ended at start (exit code {self._proc.exitcode})") from None
        if msg[0] != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process could not start: {msg[1]}")
        return self

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the child's events in ``loop`` (the HTTP server's) and watch for stalled readers."""
        self._loop = loop
        loop.add_reader(self._ev.fileno(), self._on_events)
        self._watch = loop.create_task(self._watch_stalls())

    def shutdown(self) -> None:
        """Stop the engine process (idempotent); one info line the first time."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._ev.fileno())
            if self._watch is not None:
                self._watch.cancel()
        if self._proc.pid is None:
            return
        with contextlib.suppress(OSError):
            self._cmd.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if not self._stopped:
            self._stopped = True
            log.info("the engine process stopped (server shutdown)")

    def alive(self) -> bool:
        return not self._dead and self._proc.is_alive()

    def submit(self, req: Request) -> None:
        """Send ``req`` to the engine; ``Busy`` when its tier's slots and queue are full (``Engine.submit``)."""
        if not self.alive():
            raise Busy("the server's engine has stopped; restart the server")
        n = sum(self.in_flight.values())
        if n >= self.slots + self.max_queue:
            raise Busy(f"the server is at capacity ({min(n, self.slots)} slots busy, {max(0, n - self.slots)} "
                       "requests waiting); retry shortly")
        self._next_rid += 1
        req.rid, req.on_cancel = self._next_rid, self._cancel
        self.live[req.rid] = req
        self.in_flight[req.tier] += 1
        self._cmd.send(("submit", req.rid, {k: getattr(req, k) for k in _FIELDS}))

    def _cancel(self, req: Request) -> None:
        if req.rid in self.live and self.alive():
            self._cmd.send(("cancel", req.rid))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """As ``Engine.snapshot``, as of the engine's last message."""
        out = {}
        for t in self.tiers:
            busy = min(self._busy.get(t, 0), self.in_flight[t])
            out[t] = {"slots": self.slots, "busy": busy, "waiting": self.in_flight[t] - busy}
        return out

    def _on_events(self) -> None:
        try:
            while self._ev.poll():
                msg = self._ev.recv()
                if msg[0] == "ev":
                    self._dispatch(*msg[1:])
                elif msg[0] == "stopped":
                    self._engine_died(stopped_by=msg[1])
                    return
        except (EOFError, OSError):
            self._engine_died()

    def counters(self) -> dict[str, float]:
        """``Engine.counters()`` of the engine process, as of its last message."""
        return dict(self._counters)

    def _dispatch(self, counters: dict[str, float], generated: dict[str, int], busy: dict[str, int],
                  items: list) -> None:
        self._counters, self.generated, self._busy = counters, generated, busy
        now = time.monotonic()
        for rid, kind, value, completion_tokens, first_token_at in items:
            req = self.live.get(rid)
            if req is None:
                continue
            req.completion_tokens, req.first_token_at = completion_tokens, first_token_at
            if kind != "text":
                req.finish_reason = value if kind == "done" else "error"
                del self.live[rid]
                self.in_flight[req.tier] -= 1
            if req.emitted == req.taken:
                req.consumed_at = now          # waiting for a slot is not failing to read
            req.emitted += 1
            req.queue.put_nowait((kind, value))

    def _engine_died(self, stopped_by: str | None = None) -> None:
        """The engine process ended (``stopped_by``: the signal that stopped it); the requests in flight end."""
        if self._dead:
            return
        self._dead = True
        self._loop.remove_reader(self._ev.fileno())
        if stopped_by is not None:
            self._stopped = True
            log.info("the engine process stopped (%s)%s", stopped_by,
                     f"; ending {len(self.live)} requests in flight" if self.live else "")
        else:
            self._proc.join(2)                  # its exit code (a signal: negative), not None while unreaped
            log.error("the engine process ended (exit code %s); failing %d requests", self._proc.exitcode,
                      len(self.live))
        for req in self.live.values():
            req.finish_reason = "error"
            req.emitted += 1
            req.queue.put_nowait(("unavailable", "the server is shutting down" if stopped_by is not None
                                  else "the server's engine stopped"))
        self.live.clear()
        self.in_flight = {t: 0 for t in self.tiers}
        self._busy = {}

    async def _watch_stalls(self) -> None:
        """Cancel streams whose client has not taken pending output for ``stall_timeout`` seconds."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_timeout / 4))
            now = time.monotonic()
            for req in list(self.live.values()):
                req.cancel_if_stalled(now, self.stall_timeout)
