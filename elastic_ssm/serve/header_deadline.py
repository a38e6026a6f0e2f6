"""Connection limits below uvicorn (``with_header_deadline``, a subclass of its HTTP protocol class): the request
head's deadline (408) and size (431), a write-stall abort and a close after an early answer (docs/serving.md, "Security
defaults"); a request being answered is never timed here. Unparseable bytes get a JSON 400 (uvicorn's: plain text)."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from http import HTTPStatus

from .schema import error_body

__all__ = ["with_header_deadline", "refusal_response", "MAX_HEADER_BYTES", "LINGER_S"]

log = logging.getLogger("elastic_ssm.serve")

MAX_HEADER_BYTES = 64 * 1024     #: the default bound on one request's request line and headers
LINGER_S = 2.0                   #: how long a refused connection drops what the client still sends before closing
_STEP = 8192                     #: body bytes fed to the parser at once (bounds the count of a pipelined head)
_CLOSE = (b"connection", b"close")
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_PROGRESS_BYTES = 4096          #: what the peer must acknowledge of pending output, per write timeout, to progress
_ACKED_AT = 120                  #: offset of ``tcpi_bytes_acked`` (a u64) in Linux's ``struct tcp_info`` (4.1+)
#: how early a loop timer may fire by ``time.monotonic`` (uvloop's timers count whole milliseconds, asyncio's fire
#: within the clock's resolution): the write check's deadline is met this much before it, not one check later
_TIMER_SLACK_S = 0.01


def _unacked(sock) -> tuple[int, int] | None:
    """(bytes the peer acknowledged, bytes sent and not yet acknowledged) of a TCP socket (Linux's ``TCP_INFO``,
    ``SIOCOUTQ``); None elsewhere."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        import fcntl
        import termios

        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _ACKED_AT + 8)
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError, ImportError):
        return None
    return None if len(info) < _ACKED_AT + 8 else (struct.unpack_from("Q", info, _ACKED_AT)[0], queued)


def refusal_response(status: int, message: str) -> bytes:
    """A raw HTTP/1.1 ``status`` answer in the API's error shape that closes the connection."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def with_header_deadline(base: type, seconds: float, on_refuse: Callable[[str], None], *,
                         write_timeout: float, max_header_bytes: int = MAX_HEADER_BYTES) -> type:
    """``base`` (a uvicorn HTTP protocol class) with the module docstring's limits (the values ``ServeOptions``
    checks); ``on_refuse(reason)`` counts each refusal (``"http_400"``, ``"http_408"``, ``"http_431"``, ...)."""
    answer = refusal_response(408, f"the request headers did not arrive within {seconds:g} s; send the whole "
                                   "request at once")
    too_large = refusal_response(431, f"the request line and headers are over {max_header_bytes} bytes")
    malformed = refusal_response(400, "the request is not valid HTTP/1.1 (its request line, headers or chunked body "
                                      "could not be parsed)")
    head_bound = max_header_bytes
    h11 = hasattr(base, "handle_events")       # h11's protocol parses in handle_events; httptools' in callbacks
    if h11:
        import h11 as h11_lib

    class HeaderDeadline(base):
        deadline_s = seconds
        max_header_bytes = head_bound          # (a class body cannot read an enclosing name it assigns)
        write_timeout_s = write_timeout
        count_refusal = staticmethod(on_refuse)
        _deadline = None
        _waiting_for = None   # the cycle current when the deadline was armed: a new one means headers arrived
        _stall = None         # the write-stall timer, while the transport's write buffer is above its high-water mark
        _linger = None        # set once the connection is refused: the timer of its final close
        _watch = None         # the write-progress timer (TCP_INFO), while a request runs or output is pending
        _acked = -1           # the peer's acknowledged bytes at the last progress
        _progress_at = 0.0    # when the peer last acknowledged a byte (or nothing was pending)
        _in_head = True       # httptools: a request's head is arriving (from its first byte to its headers' end)
        _head_bytes = 0       # httptools: its bytes so far (a pipelined head: from the 8 KiB piece it began in)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if h11:                                     # ours refuses first, with a 431 (h11's: a 400 past 16 KiB)
                self.conn = h11_lib.Connection(h11_lib.SERVER, max_incomplete_event_size=max_header_bytes + (1 << 20))

        def _arm(self) -> None:
            self._disarm()
            self._waiting_for = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _who(self) -> str:
            return "{}:{}".format(*self.client) if self.client else "?"

        def _refuse(self, response: bytes, linger: bool) -> None:
            """Send ``response`` and close (``linger``: after ``LINGER_S`` s of dropping what the client sends)."""
            self._disarm()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.disconnected:   # a pipelined request
                self.transport.abort()                                      # is being answered: no room for ours
                return
            self.transport.write(response)
            if not linger:                  # a client trickling its head is held no longer than its deadline
                self.transport.close()
                return
            self._linger = self.loop.call_later(LINGER_S, self.transport.close)
            try:
                self.transport.resume_reading()
                if self.transport.can_write_eof():
                    self.transport.write_eof()
            except (RuntimeError, OSError, NotImplementedError):
                self.transport.close()

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.cycle is not self._waiting_for or self._linger is not None:
                return
            log.info("closed a connection from %s whose request headers did not arrive within %g s", self._who(),
                     seconds)
            self._refuse(answer, linger=False)
            self.count_refusal("http_408")

        def _head_pending(self) -> int | None:
            """Bytes of the request head now arriving; None while none is (a body, or a cycle not yet ended)."""
            if not h11:
                return self._head_bytes if self._in_head else None
            return None if self.conn.their_state is not h11_lib.IDLE else len(self.conn.trailing_data[0])

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:             # httptools: a request's first byte
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:          # httptools
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self._linger is not None:                # refused: what the client still sends is dropped
                return
            self._feed_bounded(data)
            if self._linger is not None or self.transport.is_closing():
                return
            if self._deadline is not None and self.cycle is not self._waiting_for:
                self._disarm()          # a request's headers are complete: its cycle runs untimed here
                self._watch_writes()
            self._close_after_early_answer()

        def _feed_bounded(self, data: bytes) -> None:
            while data:
                pending = self._head_pending()
                step = max_header_bytes - pending if pending is not None else (len(data) if h11 else _STEP)
                piece, data = data[:step], data[step:]
                super().data_received(piece)
                if self.transport.is_closing():
                    return
                if not h11 and self._in_head:
                    self._head_bytes += len(piece)
                pending = self._head_pending()
                if pending is not None and pending >= max_header_bytes:
                    log.info("refused a request from %s whose request line and headers are over %d bytes",
                             self._who(), max_header_bytes)
                    self._refuse(too_large, linger=True)
                    self.count_refusal("http_431")
                    return

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes its parser refuses, in the API's error shape; a request not yet answered on
            the connection ends for the app as if its client had left (uvicorn's own 400 drops its answer too)."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.response_started:
                cycle.disconnected = True
                cycle.message_event.set()
            self._refuse(malformed, linger=True)
            self.count_refusal("http_400")

        def _close_after_early_answer(self) -> None:
            """While the current request's body is arriving, an answer closes the connection (module docstring)."""
            cycle = self.cycle
            if cycle is None or cycle.response_started:
                return
            forced = getattr(cycle, "_es_forced_close", False)
            if cycle.more_body and cycle.keep_alive and not forced:
                cycle.keep_alive, cycle._es_forced_close = False, True
                if h11 and _CLOSE not in cycle.scope["headers"]:    # h11's cycle says close when the request did
                    cycle.scope["headers"].append(_CLOSE)
                    cycle._es_close_header = True
            elif not cycle.more_body and forced:        # the whole body came before any answer: keep-alive again
                cycle.keep_alive, cycle._es_forced_close = True, False
                if getattr(cycle, "_es_close_header", False):
                    cycle.scope["headers"].remove(_CLOSE)
                    cycle._es_close_header = False

        def on_response_complete(self) -> None:
            super().on_response_complete()
            started = self.cycle is not None and not self.cycle.response_complete   # a pipelined request
            if not self.transport.is_closing() and not started:
                self._arm()

        def _watch_writes(self) -> None:
            """Start the write-progress check of the module docstring (Linux; elsewhere ``pause_writing``'s)."""
            if self._watch is not None or self._stall is not None:
                return
            self._acked, self._progress_at = -1, time.monotonic()
            self._check_writes()

        def _check_writes(self) -> None:
            self._watch = None
            if self.transport.is_closing() and self._linger is None and not self.transport.get_write_buffer_size():
                return
            state = _unacked(self.transport.get_extra_info("socket"))
            if state is None:                            # no TCP_INFO here: pause_writing's timer instead
                self._watch = False
                return
            acked, queued = state
            pending = queued + self.transport.get_write_buffer_size()
            now = time.monotonic()
            if not pending or acked - self._acked >= min(pending, _PROGRESS_BYTES) or self._acked < 0:
                self._acked, self._progress_at = acked, now
            elif now - self._progress_at >= write_timeout - _TIMER_SLACK_S:
                self._write_stalled()
                return
            if pending or (self.cycle is not None and not self.cycle.response_complete):
                self._watch = self.loop.call_later(min(1.0, write_timeout / 4), self._check_writes)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._watch is None:                      # the progress check is not running: start it
                self._watch_writes()
            if self._stall is None and self._watch is False:
                self._stall = self.loop.call_later(write_timeout, self._write_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _write_stalled(self) -> None:
            self._stall = None       # a closing transport waits for its buffer to drain: it is aborted too
            log.info("dropped a connection from %s that took (almost) none of its pending output for %g s", self._who(),
                     write_timeout)
            self.count_refusal("stalled_reader")
            self.transport.abort()

        def connection_lost(self, exc) -> None:
            self._disarm()
            for timer in (self._stall, self._linger, self._watch):
                if timer:
                    timer.cancel()
            super().connection_lost(exc)

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline
