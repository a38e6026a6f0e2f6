"""The deadline on request headers (``serve/header_deadline.py``), on real sockets through uvicorn with both of its
HTTP parsers: a client that trickles its headers, or sends none, gets a 408 and loses the connection; a whole
request, a slow answer and a second request on a kept-alive connection are not affected."""

import asyncio
import json
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

from elastic_ssm.serve.header_deadline import timeout_response, with_header_deadline  # noqa: E402

DEADLINE = 0.6
REQUEST = b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n"


def _bases():
    bases = [H11Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:      # httptools is in the serve extra, not in every install: h11 is then uvicorn's parser
        return bases
    return bases + [HttpToolsProtocol]


async def _app(scope, receive, send):
    """``/slow`` answers after twice the deadline; every path answers its own name."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * DEADLINE)
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


TIMEOUTS: list[float] = []     # when each connection the deadline closed was closed (``on_timeout``)


@pytest.fixture(params=_bases(), ids=lambda b: b.__name__)
def server(request):
    TIMEOUTS.clear()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, log_level="warning", timeout_keep_alive=30, lifespan="off",
                            http=with_header_deadline(request.param, DEADLINE,
                                                      lambda: TIMEOUTS.append(time.monotonic())))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(5)


def _connect(address):
    return socket.create_connection(address, timeout=5 * DEADLINE)


def _read_all(conn) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def _response(conn) -> bytes:
    """One response with a content-length, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _is_408(data: bytes) -> None:
    assert data.startswith(b"HTTP/1.1 408 "), data[:80]
    body = json.loads(data.partition(b"\r\n\r\n")[2])
    assert "headers did not arrive within 0.6 s" in body["error"]["message"]


def test_trickled_headers_get_a_408_and_the_connection_closes(server):
    conn = _connect(server)
    start = time.monotonic()
    try:
        for byte in b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
            conn.sendall(bytes([byte]))          # a byte every 50 ms: each resets uvicorn's own keep-alive timer
            time.sleep(0.05)
    except OSError:                              # the server closed the connection while we were still sending
        pass
    data = _read_all(conn)
    _is_408(data)
    assert DEADLINE <= time.monotonic() - start < DEADLINE + 2.0
    assert len(TIMEOUTS) == 1


def test_a_connection_that_sends_nothing_is_closed(server):
    conn = _connect(server)
    start = time.monotonic()
    _is_408(_read_all(conn))
    assert DEADLINE <= time.monotonic() - start < DEADLINE + 2.0


def test_whole_requests_slow_answers_and_kept_alive_connections_are_untouched(server):
    conn = _connect(server)
    conn.sendall(REQUEST % b"slow")                          # the answer takes twice the deadline: not timed
    assert _response(conn).endswith(b"\r\n\r\n/slow")
    for _ in range(2):                                       # kept alive: each request in time is answered
        time.sleep(DEADLINE / 2)
        conn.sendall(REQUEST % b"again")
        assert _response(conn).endswith(b"\r\n\r\n/again")
    assert not TIMEOUTS
    conn.sendall(b"GET /late HTTP/1.1\r\n")                  # the next request's headers never end
    _is_408(_read_all(conn))
    assert len(TIMEOUTS) == 1


def test_the_408_is_one_well_formed_response():
    data = timeout_response(2.5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(body) in head and b"connection: close" in head
    assert json.loads(body)["error"]["code"] == 408
    with pytest.raises(ValueError, match="positive"):
        with_header_deadline(H11Protocol, 0)
