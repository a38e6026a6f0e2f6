"""Clients that misbehave in ways the bad-field tables of ``test_serve_http.py`` do not reach: bodies that break the
JSON reader itself, text the chat path must refuse, and clients that leave in the middle of a request. Each gets a
4xx in OpenAI's error shape (or, when it has gone, nothing) and the server keeps answering."""

import json
import shutil

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
