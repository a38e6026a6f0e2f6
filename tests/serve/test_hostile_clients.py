"""Clients that misbehave in ways the bad-field tables of ``test_serve_http.py`` do not reach: bodies that break the
JSON reader itself, text the chat path must refuse, and clients that leave in the middle of a request. Each gets a
4xx in OpenAI's error shape (or, when it has gone, nothing) and the server keeps answering."""

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402


def _client(path, **kw):
    model = es.ESSH.from_pretrained(path)
    settings = ServerSettings(name="tiny", tiers=["T1", "T10"], default_tier="T10", slots=2, **kw)
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
