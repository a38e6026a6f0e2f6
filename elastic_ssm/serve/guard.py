"""``Guard``, the ASGI middleware in front of the API (docs/serving.md, "Security defaults"), and the routes'
``read_body``, ``parse_json`` and ``watch_disconnect``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import sys
import traceback
from collections import defaultdict

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from .schema import ApiError, error_body

__all__ = ["Guard", "host_allowed", "is_loopback", "read_body", "parse_json", "watch_disconnect",
           "uvicorn_connection_limit"]

log = logging.getLogger("elastic_ssm.serve")


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """Whether the host ``name`` is ``localhost`` or a loopback address."""
    ip = _ip(name)
    return name == "localhost" or (ip is not None and ip.is_loopback)


def host_allowed(value: bytes | None, allowed: frozenset[str]) -> bool:
    """Whether a ``Host`` header ``value`` names this server: loopback, or in ``allowed`` (lower case; ``0.0.0.0`` /
    ``::``: any IP address; ``*``: any host)."""
    if value is None or "*" in allowed:
        return True
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):                        # [::1]:8000
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".")
    return is_loopback(name) or name in allowed or (_ip(name) is not None and bool(allowed & {"0.0.0.0", "::"}))


class Guard:
    """Without ``api_key`` a ``Host`` not loopback nor in ``allowed_hosts`` is a 421 (None: no check); with it every
    path but ``/health`` needs the bearer key (401). 413 over ``max_body``, 429 over ``max_connections`` per client
    address, 503 over ``max_requests`` in all (``/health`` and ``/metrics`` neither); an exception escaping the app is
    OpenAI's 500."""

    def __init__(self, app, api_key: str | None, max_connections: int, max_body: int, metrics=None,
                 max_requests: int | None = None, allowed_hosts=()) -> None:
        self.app, self.max_connections, self.max_body, self.metrics = app, max_connections, max_body, metrics
        self.max_requests = max_requests
        self._hosts = None if api_key or allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self._key = f"bearer {api_key}".encode() if api_key else None     # the scheme in lower case: RFC 9110 11.1
        self._open: dict[str, int] = defaultdict(int)
        self._in_flight = 0

    async def _refuse(self, scope, send, reason: str | None, status: int, message: str, headers=None) -> None:
        """Answer ``status`` in the API's error shape, counted under ``reason`` (None: not counted)."""
        if self.metrics is not None and reason is not None:
            self.metrics.reject(reason)
        await JSONResponse(error_body(status, message), status, headers)(scope, None, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if [name for name, _ in scope.get("headers") or []].count(b"host") > 1:     # RFC 9112 3.2: a 400
            await self._refuse(scope, send, "http_400", 400, "the request has more than one Host header; send one")
            return
        if self._hosts is not None and not host_allowed(headers.get(b"host"), self._hosts):
            await self._refuse(scope, send, "misdirected_host", 421, "this server answers requests for its own "
                               "address only: without an API key, a Host other than localhost or a loopback address "
                               "needs --allowed_hosts")
            return
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if self._key is not None and scope.get("path") != "/health" and \
                not hmac.compare_digest(scheme.lower() + b" " + token.lstrip(b" "), self._key):
            await self._refuse(scope, send, "unauthorized", 401, "missing or wrong API key: send "
                               "'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._refuse(scope, send, "body_too_large", 413, f"request body over {self.max_body} bytes")
            return
        if scope.get("path") in ("/health", "/metrics"):     # outside the caps: a full server is still watched
            await self._run(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown", 0))[0]
        if self._open[client] >= self.max_connections:
            await self._refuse(scope, send, "too_many_connections", 429, f"more than {self.max_connections} "
                               f"concurrent requests from {client}; wait for one to finish", {"Retry-After": "1"})
            return
        if self.max_requests is not None and self._in_flight >= self.max_requests:
            await self._refuse(scope, send, "server_full", 503, f"the server has {self.max_requests} requests in "
                               "flight (--max-connections); retry shortly", {"Retry-After": "1"})
            return
        self._open[client] += 1
        self._in_flight += 1
        try:
            await self._run(scope, receive, send)
        finally:
            self._in_flight -= 1
            self._open[client] -= 1
            if not self._open[client]:
                del self._open[client]

    async def _run(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as e:          # a bug, not the client's fault: one line, a counter, OpenAI's 500
            where = traceback.extract_tb(e.__traceback__)[-1]
            log.error("%s %s failed: %s (%s:%d)", scope.get("method"), scope.get("path"),
                      " ".join(f"{type(e).__name__}: {e}".split()), where.filename, where.lineno)
            if self.metrics is not None:
                self.metrics.server_errors.inc()
            with contextlib.suppress(Exception):     # the answer had started (a stream): it ends here
                await self._refuse(scope, send, None, 500, f"the server failed on this request ({type(e).__name__}); "
                                   "it keeps serving: retry, or report it with the server's log")


def uvicorn_connection_limit(max_requests: int) -> int:
    """uvicorn's ``limit_concurrency``: room for every request to reach ``Guard``; idle keep-alives bounded."""
    return 2 * max_requests + 1


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The request body, at most ``limit`` bytes within ``timeout`` s (413, 408; 499 for a client gone meanwhile)."""
    body = bytearray()

    async def _read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body over {limit} bytes")

    try:
        await asyncio.wait_for(_read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected before sending the whole request body") from None
    return bytes(body)


def parse_json(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 encoded JSON") from None
    except json.JSONDecodeError as e:   # some messages end in "at" already ("Unterminated string starting at")
        where = "" if e.msg.endswith(" at") else " at"
        raise ApiError(400, f"the request body is not valid JSON ({e.msg}{where} position {e.pos})") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply") from None
    except ValueError:          # JSONDecodeError above; this: an integer longer than Python converts
        raise ApiError(400, f"the request body holds an integer of over {sys.get_int_max_str_digits()} digits; "
                            "no field takes one, send a shorter number") from None


async def watch_disconnect(receive, req) -> None:
    """Cancel ``req`` when the client disconnects (run as a task once the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            req.cancel()
            return
