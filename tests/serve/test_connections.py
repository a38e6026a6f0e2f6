"""A real ``elastic-ssm serve`` process over real sockets, attacked at the connection level: an oversized header
block (431), answers sent before their body (408, 413: the connection closes), clients that stop reading (dropped,
their places under both connection caps given back), a forged ``X-Forwarded-For``, ``/health`` and ``/metrics`` at
the caps, a foreign ``Host`` (421) and a body that is not JSON (415)."""

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from served import serve_process  # noqa: E402

TIMEOUT = 2          # --timeout: headers, body, and a client that takes no output
PER_CLIENT, ALL = 2, 3


@pytest.fixture(scope="module")
def port(tiny_dir):
    with serve_process(tiny_dir, "--tiers", "T1", "--max_batch", "4", "--timeout", str(TIMEOUT),
                       "--max_connections_per_client", str(PER_CLIENT), "--max_connections", str(ALL),
                       "--max_tokens_limit", "200000") as port:
        yield port


def _connect(port, source="127.0.0.1", rcvbuf=None):
    conn = socket.socket()
    if rcvbuf:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    conn.settimeout(30)
    conn.bind((source, 0))
    conn.connect(("127.0.0.1", port))
    return conn


def _raw(method, path, body=b"", headers=None, port=0) -> bytes:
    head = {"host": f"127.0.0.1:{port}", "content-type": "application/json", **(headers or {})}
    if (body or method == "POST") and "content-length" not in head:
        head["content-length"] = str(len(body))
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def _read_all(conn) -> bytes:
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _ask(port, method, path, body=None, source="127.0.0.1", headers=None) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one request on a connection of its own (closed by the server after it)."""
    raw = json.dumps(body).encode() if body is not None else b""
    with _connect(port, source) as conn:
        conn.sendall(_raw(method, path, raw, {"connection": "close", **(headers or {})}, port))
        data = _read_all(conn)
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


def _complete(port, source="127.0.0.1", headers=None) -> int:
    return _ask(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, source, headers)[0]


def _send_quietly(conn, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:          # the server closed the connection while we were still sending
        pass


def _is_closed(conn) -> bool:
    """Whether the server has closed ``conn`` (a request sent on it is answered with the end of the stream)."""
    try:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    except OSError:
        return True
    return _read_all(conn) == b""


def test_a_1mb_header_gets_a_431_while_the_server_keeps_answering(port):
    conn = _connect(port)
    head = _raw("GET", "/v1/models", headers={"x-filler": "a" * (1 << 20)}, port=port)
    sender = threading.Thread(target=_send_quietly, args=(conn, head), daemon=True)
    sender.start()
    assert _ask(port, "GET", "/health")[0] == 200                      # meanwhile
    data = _read_all(conn)                                              # the 431, then the end of the connection
    status = data.partition(b"\r\n")[0]
    assert status.startswith(b"HTTP/1.1 431"), data[:200]
    error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == 431 and "65536 bytes" in error["message"]
    sender.join(10)
    for method, path in (("POST", "/v1/completions"), ("GET", "/nowhere"), ("DELETE", "/health")):
        with _connect(port) as conn:
            _send_quietly(conn, _raw(method, path, headers={f"x-h{i}": "b" * 100 for i in range(700)}, port=port))
            assert _read_all(conn).startswith(b"HTTP/1.1 431"), (method, path)
    assert _complete(port) == 200


def test_413_and_408_close_the_connection_and_the_next_request_is_not_swallowed(port):
    with _connect(port) as conn:
        conn.sendall(_raw("POST", "/v1/completions", headers={"content-length": str(2 << 20)}, port=port))
        conn.settimeout(10)
        data = _read_all(conn)                                          # ends: the server closed the connection
        assert data.startswith(b"HTTP/1.1 413") and b"connection: close" in data.lower(), data
        assert data.count(b"HTTP/1.1") == 1 and _is_closed(conn)
    with _connect(port) as conn:                                        # a body slower than --timeout
        conn.sendall(_raw("POST", "/v1/completions", headers={"content-length": "100"}, port=port) + b'{"prompt"')
        start = time.monotonic()
        data = _read_all(conn)
        assert data.startswith(b"HTTP/1.1 408") and b"connection: close" in data.lower(), data
        assert TIMEOUT - 0.5 < time.monotonic() - start < TIMEOUT + 5
        assert _is_closed(conn)
    assert _complete(port) == 200


def test_a_foreign_host_gets_421_and_a_body_that_is_not_json_415(port):
    for host in ("evil.example", f"evil.example:{port}", "192.168.7.7"):
        status, _, body = _ask(port, "POST", "/v1/completions", {"prompt": "hi"}, headers={"host": host})
        assert status == 421 and json.loads(body)["error"]["code"] == 421, (host, body)
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert _complete(port, headers={"host": host}) == 200, host
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=z"):
        status, _, body = _ask(port, "POST", "/v1/completions", {"prompt": "hi"}, headers={"content-type": kind})
        assert status == 415 and json.loads(body)["error"]["code"] == 415, (kind, body)
    assert _complete(port, headers={"content-type": None}) == 200      # no Content-Type: read as JSON


def _stalled(port, source):
    """A streaming request for 100,000 tokens whose client never reads (a 4 KiB receive buffer)."""
    conn = _connect(port, source, rcvbuf=4096)
    body = json.dumps({"prompt": "hi", "max_tokens": 100000, "stream": True}).encode()
    conn.sendall(_raw("POST", "/v1/completions", body, port=port))
    return conn


def _until(what, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.2)
    return False


def test_clients_that_stop_reading_are_dropped_and_give_their_places_back(port):
    """Two stalled streams from 127.0.0.1 fill its cap (a forged X-Forwarded-For does not escape it; /health
    and /metrics answer), a third from 127.0.0.2 fills the server's (they answer); after --timeout without taking
    any output the three are dropped and both caps take requests again."""
    held = [_stalled(port, "127.0.0.1"), _stalled(port, "127.0.0.1")]
    assert _until(lambda: _complete(port) == 429, 10)
    assert _complete(port, headers={"x-forwarded-for": "10.9.9.9"}) == 429     # no proxy is trusted
    assert _ask(port, "GET", "/health")[0] == 200                               # at the per-client cap
    assert _ask(port, "GET", "/metrics")[0] == 200                  # a scrape too (it was a 429 / 503 under load)
    held.append(_stalled(port, "127.0.0.2"))
    assert _until(lambda: _complete(port, "127.0.0.3") == 503, 10)
    assert _ask(port, "GET", "/health", source="127.0.0.3")[0] == 200           # at the server's cap
    assert _ask(port, "GET", "/metrics", source="127.0.0.3")[0] == 200
    start = time.monotonic()
    assert _until(lambda: _complete(port, "127.0.0.3") == 200 and _complete(port) == 200, 60)
    assert time.monotonic() - start < 60
    for conn in held:                     # each was closed: what the buffers held, then the end, at once
        conn.settimeout(10)
        start = time.monotonic()
        assert len(_read_all(conn)) < 20 << 20 and time.monotonic() - start < 10
        conn.close()
