"""A deadline on each request's headers, below uvicorn (the slow-headers attack, "slowloris").

uvicorn times nothing between a connection's opening (or the end of its last response) and the end of the
next request's headers: ``timeout_keep_alive`` is armed only after a response and is reset by every byte
received. A client that opens connections and trickles header bytes, or sends none, holds each one open for
ever, and enough of them fill ``limit_concurrency`` (``guard.uvicorn_connection_limit``), after which every
real request is refused. ASGI middleware (``guard.Guard``) cannot help: it runs only once the headers are in.

``with_header_deadline(base, seconds)`` subclasses uvicorn's HTTP protocol class ``base`` (httptools' or h11's):
the deadline is armed when a connection opens and again when a response ends, and disarmed when a request's
headers are complete (uvicorn then starts that request's cycle, ``self.cycle``, in either implementation).
A client past it gets a 408 in the API's error shape and the connection is closed. The body has its own time
limit (``guard.read_body``, 408 too); a request being answered is never timed here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from .protocol import error_body

__all__ = ["with_header_deadline", "timeout_response"]

log = logging.getLogger("elastic_ssm.serve")


def timeout_response(seconds: float) -> bytes:
    """The raw HTTP/1.1 408 sent to a client whose headers did not arrive within ``seconds``."""
    body = json.dumps(error_body(408, f"the request headers did not arrive within {seconds:g} s; send the "
                                      "whole request at once")).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def with_header_deadline(base: type, seconds: float, on_timeout: Callable[[], None] | None = None) -> type:
    """``base`` (a uvicorn HTTP protocol class) with a deadline of ``seconds`` on every request's headers;
    ``on_timeout`` is called for each connection closed by it (``serve`` counts them in ``/metrics`` as
    ``elastic_ssm_rejected_total{reason="http_408"}``)."""
    if not seconds > 0:
        raise ValueError(f"the header deadline must be positive, got {seconds!r}")
    answer = timeout_response(seconds)

    class HeaderDeadline(base):
        deadline_s = seconds
        count_timeout = staticmethod(on_timeout or (lambda: None))
        _deadline = None
        _waiting_for = None   # the cycle current when the deadline was armed: a new one means headers arrived

        def _arm(self) -> None:
            self._disarm()
            self._waiting_for = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.cycle is not self._waiting_for:
                return
            log.info("closed a connection from %s whose request headers did not arrive within %g s",
                     "{}:{}".format(*self.client) if self.client else "?", seconds)
            self.transport.write(answer)
            self.transport.close()
            self.count_timeout()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_for:
                self._disarm()          # a request's headers are complete: its cycle runs untimed here

        def on_response_complete(self) -> None:
            super().on_response_complete()
            started = self.cycle is not None and not self.cycle.response_complete   # a pipelined request
            if not self.transport.is_closing() and not started:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline
