"""A served request, and ``deliver``: its events reach their event loop in one thread-safe call per loop."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request", "Busy", "deliver"]

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
