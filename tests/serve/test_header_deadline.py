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

from elastic_ssm.serve.header_deadline import refusal_response, with_header_deadline  # noqa: E402

DEADLINE = 0.6
SLACK = 0.01     # a loop timer may fire up to its clock resolution early (libuv, under uvloop: 1 ms)
REQUEST = b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n"


def _bases():
    bases = [H11Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:      # httptools is in the serve extra, not in every install: h11 is then uvicorn's parser
        return bases
    return bases + [HttpToolsProtocol]


STREAMS_ENDED: list[float] = []   # when each ``/stream`` learned that its client was gone


async def _stream(receive, send):
    """64 KiB chunks until the client is gone (uvicorn's ``receive`` then says ``http.disconnect``)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    gone = asyncio.ensure_future(receive())
    while not gone.done():
        await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        await asyncio.sleep(0)
    STREAMS_ENDED.append(time.monotonic())


async def _app(scope, receive, send):
    """``/slow`` answers after twice the deadline, ``/stream`` streams until its client leaves; every other path
    answers its own name (a POST without reading its body)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        return await _stream(receive, send)
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * DEADLINE)
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


TIMEOUTS: list[float] = []     # when each connection the deadline closed was closed (``on_refuse("http_408")``)
REFUSED: list[str] = []        # every ``on_refuse`` reason


@pytest.fixture(params=_bases(), ids=lambda b: b.__name__)
def server(request):
    TIMEOUTS.clear()
    REFUSED.clear()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    STREAMS_ENDED.clear()
    config = uvicorn.Config(_app, log_level="warning", timeout_keep_alive=30, lifespan="off",
                            http=with_header_deadline(request.param, DEADLINE,
                                                      lambda r: REFUSED.append(r) or r == "http_408" and
                                                      TIMEOUTS.append(time.monotonic()),
                                                      write_timeout=DEADLINE))
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
    assert DEADLINE - SLACK <= time.monotonic() - start < DEADLINE + 2.0
    assert len(TIMEOUTS) == 1


def test_a_connection_that_sends_nothing_is_closed(server):
    start = time.monotonic()                 # before connecting: the server's deadline starts once it accepts
    conn = _connect(server)
    _is_408(_read_all(conn))
    assert DEADLINE - SLACK <= time.monotonic() - start < DEADLINE + 2.0


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
    data = refusal_response(408, "the request headers did not arrive within 2.5 s")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(body) in head and b"connection: close" in head
    assert json.loads(body)["error"]["code"] == 408


def _head(size: int, path: bytes = b"/") -> bytes:
    """A GET whose request line and headers are ``size`` bytes in all."""
    start, end = b"GET %s HTTP/1.1\r\nhost: x\r\nx-big: " % path, b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_a_header_block_over_the_bound_gets_a_431_and_the_connection_closes(server):
    """The bound holds for the whole head, as it arrives, with either parser: one 1 MB header (sent while another
    connection is answered), many small ones, a long path, after a first request kept alive."""
    conn = _connect(server)
    sender = threading.Thread(target=lambda: _send_quietly(conn, _head(1 << 20)), daemon=True)
    sender.start()
    other = _connect(server)
    other.sendall(REQUEST % b"meanwhile")
    assert _response(other).endswith(b"/meanwhile")
    data = _read_all(conn)                         # the 431, then the end of the connection
    assert data.startswith(b"HTTP/1.1 431 ") and b"connection: close" in data, data[:200]
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 431
    sender.join(5)
    many = b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-h: 0123456789abcdef\r\n" * 4000 + b"\r\n"
    long_path = b"POST /" + b"p" * 70000 + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    for head in (many, long_path, _head(65537)):
        conn = _connect(server)
        _send_quietly(conn, head)
        assert _read_all(conn).startswith(b"HTTP/1.1 431 "), head[:40]
    conn = _connect(server)                        # at the bound: answered, and the next one on it too
    conn.sendall(_head(65536, b"/first"))
    assert _response(conn).endswith(b"/first")
    _send_quietly(conn, _head(200000))
    assert _read_all(conn).startswith(b"HTTP/1.1 431 ")


def _send_quietly(conn, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


def test_an_answer_before_the_whole_body_closes_the_connection(server):
    """Kept alive, the parser would read the client's next request as the rest of the declared body."""
    conn = _connect(server)
    conn.sendall(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n")
    head = _response(conn)
    assert head.endswith(b"/early") and b"connection: close" in head.lower()
    _send_quietly(conn, REQUEST % b"next")
    try:
        assert conn.recv(65536) == b""            # closed: the next request is not swallowed
    except ConnectionResetError:
        pass
    conn = _connect(server)                        # a body sent whole with its head: kept alive as before
    conn.sendall(b"POST /whole HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
    assert b"connection: close" not in _response(conn).lower()
    conn.sendall(REQUEST % b"again")
    assert _response(conn).endswith(b"/again")


def test_a_client_that_stops_reading_is_dropped(server):
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.connect(server)
    conn.sendall(REQUEST % b"stream")              # and never reads
    start = time.monotonic()
    while not STREAMS_ENDED and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert STREAMS_ENDED and STREAMS_ENDED[0] - start < DEADLINE + 5
    conn.close()


@pytest.mark.parametrize("head, rest", [
    (b"\x00\x01 not http\r\n\r\n", b""),
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n", b""),
    (b"POST /slow HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n", b"zz\r\nhello\r\n0\r\n\r\n"),
], ids=["garbage", "content-length", "chunk-in-a-body"])
def test_bytes_the_parser_refuses_get_one_json_400_and_the_connection_closes(server, head, rest):
    """uvicorn's own answer is plain text; a bad chunk arrives while /slow runs: its answer is dropped, not sent."""
    conn = _connect(server)
    conn.sendall(head)
    if rest:
        time.sleep(DEADLINE / 4)
        conn.sendall(rest)
    data = _read_all(conn)
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head and b"connection: close" in head
    error = json.loads(body)["error"]            # the whole rest: no second answer after it
    assert error["code"] == 400 and "not valid HTTP/1.1" in error["message"]
    assert REFUSED == ["http_400"]
    other = _connect(server)
    other.sendall(REQUEST % b"after")
    assert _response(other).endswith(b"/after")
