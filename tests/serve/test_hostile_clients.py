"""Clients that misbehave in ways the bad-field tables of ``test_serve_http.py`` do not reach: bodies that break the
JSON reader itself, text the chat path must refuse, and clients that leave in the middle of a request. Each gets a
4xx in OpenAI's error shape (or, when it has gone, nothing) and the server keeps answering."""

import asyncio
import gzip
import json
import shutil

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402


def _client(path, **kw):
    model = es.ESSH.from_pretrained(path)
    settings = ServerSettings(name="tiny", tiers=["T1", "T10"], default_tier="T10", slots=2,
                              allowed_hosts=("testserver",), **kw)
    return TestClient(create_app(model, settings))


def test_an_integer_past_pythons_digit_limit_is_a_400(tiny_dir):
    """``json.loads`` refuses an integer of more than 4,300 digits with a ``ValueError`` that is no
    ``JSONDecodeError``: it was a 500 with a traceback."""
    with _client(tiny_dir) as c:
        r = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "integer of over 4300 digits" in message and "\n" not in message
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_chat_message_with_an_unpaired_surrogate_is_a_400(tiny_dir, tmp_path):
    """JSON may carry ``\\ud800``; a completion's prompt is refused for it, and a chat message's text is too (the
    tokenizer's UTF-8 encoding of the rendered prompt was a 500 with a traceback)."""
    path = tmp_path / "templated"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}"
                                                            "{{ m.role }}: {{ m.content }}\n{% endfor %}"}))
    with _client(path) as c:
        for message in ('{"role": "user", "content": "hi \\ud800"}', '{"role": "\\udfff", "content": "hi"}',
                        '{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}'):
            r = c.post("/v1/chat/completions", content=b'{"max_tokens": 2, "messages": [%s]}' % message.encode())
            assert r.status_code == 400, (message, r.text)
            assert r.json()["error"]["message"] == "messages hold text that is not valid UTF-8 (an unpaired surrogate)"
        ok = c.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text


def test_a_template_refusal_quoting_an_unpaired_surrogate_is_a_400_not_a_500(tiny_dir):
    """A template's ``raise_exception`` may quote the client's text ('Unknown role: ...'): with ``\\udfff`` in it the
    refusal's JSON could not be encoded, a 500."""
    refuse = "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('Unknown role: ' + m.role) }}" \
             "{% endif %}{{ m.content }}{% endfor %}"
    with _client(tiny_dir, chat_template=refuse) as c:
        r = c.post("/v1/chat/completions", content=b'{"messages": [{"role": "\\udfff", "content": "x"}]}')
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "messages hold text that is not valid UTF-8 (an unpaired surrogate)"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]})
        assert "refused these messages: Unknown role: bot" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "b" * 5000, "content": "x"}]})
        assert len(r.json()["error"]["message"]) < 300              # a refusal quoting a long text: cut


def _drive(app, body: bytes, more_body: bool = False, leave_after_text: bool = False) -> list[dict]:
    """Run one ``POST /v1/completions`` through the ASGI ``app`` as uvicorn does (spec 2.3), for a client that
    sends ``body`` (``more_body``: and then leaves before the rest) or, ``leave_after_text``, leaves once the
    first text of the answer has been sent. Returns the messages the app sent."""
    sent: list[dict] = []
    text_sent = asyncio.Event()
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": more_body}
        if leave_after_text:
            await text_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and b'"text": "' in message.get("body", b""):
            text_sent.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body) + 10).encode())]}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_stream_whose_client_leaves_counts_as_499_not_200(tiny_dir):
    """Starlette ends a stream whose client disconnects before the engine reports the request cancelled: it was
    counted and logged as a 200 with ``finish=None``."""
    with _client(tiny_dir) as c:
        body = json.dumps({"prompt": "hi", "max_tokens": 2000, "temperature": 0, "stream": True}).encode()
        sent = _drive(c.app, body, leave_after_text=True)
        assert sent[0]["status"] == 200 and not any(b"[DONE]" in m.get("body", b"") for m in sent)
        metrics = c.get("/metrics").text
        assert 'elastic_ssm_requests_total{status="499",tier="T10"} 1' in metrics
        assert 'status="200"' not in metrics


def test_a_client_that_leaves_during_its_upload_ends_quietly(tiny_dir):
    """A body cut off by a disconnect: Starlette's ``ClientDisconnect`` escaped the handler, and uvicorn logged
    "Exception in ASGI application" with a traceback for each such client. Now a 499 no one reads, counted."""
    with _client(tiny_dir) as c:
        sent = _drive(c.app, b'{"prompt": "hi", "max_to', more_body=True)
        assert sent[0]["status"] == 499
        assert 'elastic_ssm_rejected_total{reason="http_499"} 1' in c.get("/metrics").text
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_json_error_reads_as_one_phrase(tiny_dir):
    """``json``'s messages that end in "at" ("Unterminated string starting at") read "starting at at position"."""
    with _client(tiny_dir) as c:
        for body, words in ((b'{"prompt": "abc', "Unterminated string starting at position 11"),
                            (b'{"prompt": "a\x01"}', "Invalid control character at position 13"),
                            (b"{", "Expecting property name enclosed in double quotes at position 1")):
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_compressed_body_is_a_415_naming_the_encoding(tiny_dir):
    """A gzip body was a 400 "not UTF-8 encoded JSON" and a plain body labelled ``br`` was read as if plain."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    with _client(tiny_dir) as c:
        for coding, raw in (("gzip", gzip.compress(body)), ("br", body)):
            r = c.post("/v1/completions", content=raw, headers={"Content-Encoding": coding})
            assert r.status_code == 415, r.text
            assert r.json()["error"]["message"] == f"Content-Encoding {coding!r} is not supported; send the body " \
                                                   "uncompressed"
        assert c.post("/v1/completions", content=body, headers={"Content-Encoding": "identity"}).status_code == 200


def test_a_request_with_two_host_headers_is_a_400(tiny_dir):
    """RFC 9112 3.2 (a server MUST answer 400): the Host check read the last one ("evil.example", then "localhost"
    passed), while a proxy in front, or Starlette's ``request.headers``, reads the first."""
    with _client(tiny_dir) as c:
        for hosts in (("evil.example", "localhost"), ("localhost", "localhost")):
            r = c.get("/v1/models", headers=[("host", hosts[0]), ("host", hosts[1])])
            assert r.status_code == 400, (hosts, r.text)
            assert r.json()["error"]["message"] == "the request has more than one Host header; send one"
        assert c.get("/v1/models", headers={"host": "localhost"}).status_code == 200
