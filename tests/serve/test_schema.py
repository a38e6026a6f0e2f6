"""The bodies as pydantic models on the FastAPI routes (``serve/schema.py``): ``/openapi.json`` describes them with
the server's own limits, a validation error is OpenAI's 400 naming the field, an exception inside the server is
OpenAI's 500 with one log line and a counter, and each app keeps its metrics in a registry of its own."""

import json
import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402


def _client(path, **kw):
    model = es.ESSH.from_pretrained(path)
    settings = ServerSettings(name="tiny", tiers=["T1", "T10"], default_tier="T10", slots=2, max_tokens_limit=32,
                              allowed_hosts=("testserver",), **kw)
    return TestClient(create_app(model, settings))


def test_openapi_describes_every_route_with_the_servers_limits_and_no_422(tiny_dir):
    with _client(tiny_dir, api_key="k") as c:
        assert c.get("/openapi.json").status_code == 401                      # behind the key, as every route
        spec = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
        key = {"Authorization": "Bearer k"}
        assert c.get("/docs", headers=key).status_code == 404 and c.get("/redoc", headers=key).status_code == 404
    assert set(spec["paths"]) == {"/health", "/v1/models", "/v1/models/{model_id}", "/v1/completions",
                                  "/v1/chat/completions", "/metrics"}
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) == 7, ids          # unique (OpenAPI 3): GET and HEAD /health shared one
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "CompletionResponse", "ChatCompletionResponse",
            "ModelList", "ErrorResponse"} <= set(schemas)
    assert "HTTPValidationError" not in schemas                              # refusals are 400s, never 422
    post = spec["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert set(post["responses"]) == {"200", "4XX", "5XX"}
    fields = schemas["CompletionRequest"]["properties"]
    assert fields["max_tokens"]["maximum"] == 32 and fields["max_tokens"]["default"] == 16
    chat = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]    # was 16: a chat runs to eos or the limit
    assert chat["maximum"] == 32 and chat["default"] == 32
    assert fields["top_k"]["maximum"] == es.ESSH.from_pretrained(tiny_dir).config.vocab_size
    assert schemas["CompletionRequest"]["required"] == ["prompt"]


BAD = [
    (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "temperature must be a number in [0, 2], got 10"),
    (b'{"prompt": "hi", "top_p": 1' + b"0" * 400 + b"}", "top_p must be a number in (0, 1]"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature must be a number in [0, 2], got nan"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p must be a number in (0, 1], got inf"),
    (b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens must be an integer in [0, 32], got '5'"),
    (b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage must be true or false, got 1"),
    (b'{"prompt": "hi", "presence_penalty": 0.5}', "presence_penalty is not supported by this server"),
    (b'{"prompt": "hi", "stop": ""}', "stop must be a string or a list of at most 4 non-empty strings"),
    (b'{"prompt": "hi", "stop": "\\ud800"}', "stop is not valid UTF-8 text (it holds an unpaired surrogate)"),
    (b'{"prompt": "hi", "stop": ["a", "\\udc00"]}', "stop is not valid UTF-8 text"),
    (b'{"max_tokens": 2}', "prompt is required"),
    (b"[]", "the request body must be a JSON object"),
]


def test_each_bad_field_is_a_400_that_names_it(tiny_dir):
    with _client(tiny_dir) as c:
        for body, words in BAD:
            r = c.post("/v1/completions", content=body)
            error = r.json()["error"]
            assert r.status_code == 400 and error["message"].startswith(words), (body[:60], r.text)
            assert error["type"] == "invalid_request_error" and len(error["message"]) < 200
            field = words.split()[0].split(".")[0]
            assert error["param"] == (None if field == "the" else field)
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
            plain = c.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": kind})
            assert plain.status_code == 415, (kind, plain.text)      # what a web page may post to another site
            assert "Content-Type: application/json" in plain.json()["error"]["message"]
        for kind in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd.x+json"):
            r = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}', headers={"Content-Type": kind})
            assert r.status_code == 200, (kind, r.text)
        ok = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2, "temperature": null, "n": 1}')
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2     # null: the default


def test_an_exception_in_the_server_is_one_log_line_a_counter_and_openais_500(tiny_dir, caplog):
    with _client(tiny_dir) as c:
        def broken(req):
            raise RuntimeError("a bug\nover two lines")

        submit, c.app.state.engine.submit = c.app.state.engine.submit, broken
        with caplog.at_level(logging.ERROR, logger="elastic_ssm.serve"):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert (error["code"], error["type"]) == (500, "server_error") and "RuntimeError" in error["message"]
        (record,) = [x for x in caplog.records if x.levelno >= logging.ERROR]
        text = record.getMessage()
        assert "POST /v1/completions failed: RuntimeError: a bug over two lines" in text and "\n" not in text
        assert record.exc_info is None                                            # no traceback
        c.app.state.engine.submit = lambda req: req.queue.put_nowait(("text",))     # a malformed event
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="elastic_ssm.serve"):
            r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})   # fails once it has started
        assert r.status_code == 200 and "[DONE]" not in r.text
        (record,) = [x for x in caplog.records if x.levelno >= logging.ERROR]
        assert "IndexError" in record.getMessage() and record.exc_info is None
        c.app.state.engine.submit = submit
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert "elastic_ssm_server_errors_total 2.0" in c.get("/metrics").text


def test_two_apps_in_one_process_keep_their_own_metrics(tiny_dir):
    with _client(tiny_dir) as a, _client(tiny_dir) as b:
        assert a.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert a.post("/v1/completions", json={"prompt": "hi", "n": 2}).status_code == 400
        mine, theirs = a.get("/metrics").text, b.get("/metrics").text
    assert 'elastic_ssm_requests_total{status="200",tier="T10"} 1.0' in mine
    assert 'elastic_ssm_rejected_total{reason="http_400"} 1.0' in mine
    assert "elastic_ssm_requests_total{" not in theirs and "elastic_ssm_rejected_total{" not in theirs
    assert 'elastic_ssm_slots{tier="T1"} 2.0' in theirs


def test_a_chat_body_is_validated_as_a_chat_request(tiny_dir, tmp_path):
    import shutil

    path = tmp_path / "chatty"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages[0].content }}"}))
    with _client(path) as c:
        for body, words in (({"messages": []}, "messages must be a non-empty list"),
                            ({"messages": [{"content": "x"}]}, "messages[0].role is required"),
                            ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99},
                             "max_completion_tokens must be an integer in [0, 32]")):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(words), r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 3, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3    # chat's name wins


def test_without_a_key_only_local_hosts_are_answered(tiny_dir):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 reaches a keyless local server
    with ``Host: evil.example``: a 421 on every path. Loopback names and addresses, and ``allowed_hosts``, pass; a
    key turns the check off (the key is the protection then)."""
    model = es.ESSH.from_pretrained(tiny_dir)

    def app(**kw):
        return create_app(model, ServerSettings(name="tiny", tiers=["T1"], default_tier="T1", slots=1, **kw))

    with TestClient(app(allowed_hosts=("my.lan",))) as c:
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "10.0.0.1", "[::2]:80"):
            for r in (c.get("/health", headers={"Host": host}), c.get("/v1/models", headers={"Host": host}),
                      c.post("/v1/completions", json={"prompt": "hi"}, headers={"Host": host})):
                assert r.status_code == 421 and r.json()["error"]["code"] == 421, (host, r.text)
        for host in ("localhost", "LOCALHOST:8000", "127.0.0.1:9", "127.3.4.5", "[::1]:8000", "my.lan", "my.lan:80"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert 'elastic_ssm_rejected_total{reason="misdirected_host"} 15.0' in c.get(
            "/metrics", headers={"Host": "localhost"}).text
    with TestClient(app(allowed_hosts=("0.0.0.0",))) as c:          # a wildcard bind: any address, no other name
        assert c.get("/v1/models", headers={"Host": "192.168.1.5:8000"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 421
    with TestClient(app(api_key="k")) as c:
        assert c.get("/v1/models", headers={"Host": "evil.example", "Authorization": "Bearer k"}).status_code == 200
