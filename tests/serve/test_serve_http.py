"""The HTTP API in process (FastAPI's TestClient): key, limits, every kind of bad request, 503, chat, metrics. The
``serve`` command's start-up: ``test_serve_command.py``."""

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402
from elastic_ssm.serve.engine import COUNTERS, Busy  # noqa: E402

KEY = {"Authorization": "Bearer s3cret"}


def _client(path, **kw):
    model = es.ESSH.from_pretrained(path)
    settings = ServerSettings(name="tiny", tiers=["T1", "T10"], default_tier="T10", slots=2,
                              **{"max_body_bytes": 4000, "max_prompt_tokens": 64, "max_tokens_limit": 32,
                                 "allowed_hosts": ("testserver",), **kw})
    return TestClient(create_app(model, settings))


def _complete(c, headers=KEY, **body):
    return c.post("/v1/completions", headers=headers, json={"model": "tiny", "prompt": "hi", "max_tokens": 3, **body})


def test_key_limits_and_still_serving(model_dir):
    with _client(model_dir, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200                    # health needs no key
        assert c.get("/v1/models").status_code == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert _complete(c, headers={}).status_code == 401
        assert c.get("/metrics").status_code == 401
        ids = [m["id"] for m in c.get("/v1/models", headers=KEY).json()["data"]]
        assert ids == ["tiny", "tiny@T1", "tiny@T10"]
        big = c.post("/v1/completions", headers=KEY, content=b'{"prompt": "' + b"a" * 5000 + b'"}')
        assert big.status_code == 413 and "over 4000 bytes" in big.json()["error"]["message"]
        long = _complete(c, prompt="x" * 65)
        assert long.status_code == 400 and "at most 64" in long.json()["error"]["message"]
        assert _complete(c, max_tokens=33).status_code == 400
        ok = _complete(c, temperature=0)
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        assert body["model"] == "tiny@T10" and body["choices"][0]["finish_reason"] == "length"


def test_an_unserved_tier_names_the_field_that_named_it(model_dir):
    """``model: "tiny@T7"`` answered ``param: "tier"``, a field the client never sent."""
    with _client(model_dir) as c:
        for fields, param in (({"model": "tiny@T7"}, "model"), ({"tier": "T7"}, "tier"), ({"model": "tiny@T7",
                                                                                          "tier": "T7"}, "tier")):
            error = _complete(c, headers={}, **fields).json()["error"]
            assert error["param"] == param and error["message"].startswith(f"{param} "), (fields, error)


def test_an_error_quotes_at_most_a_few_words_of_a_long_name(model_dir):
    """A 5,000-character ``model`` or ``tier`` came back whole inside the one-line message (a path too), though a
    bad field's value is cut to 40 characters."""
    long = "m" * 5000
    with _client(model_dir, max_body_bytes=1 << 20) as c:
        for r in (_complete(c, headers={}, model=long), _complete(c, headers={}, model=f"tiny@{long}"),
                  _complete(c, headers={}, tier=long), _complete(c, headers={}, model="tiny@T1", tier=long),
                  c.get(f"/v1/models/{long}"), c.get(f"/{long}")):
            assert r.status_code in (400, 404) and len(r.json()["error"]["message"]) < 300, r.text[:200]


def test_a_batch_of_one_token_id_list_is_a_prompt_as_a_batch_of_one_string_is(model_dir):
    """``prompt: [[104, 105]]`` (what lm-eval's local-completions sends at batch size 1, tokenized) was a 400 while
    ``["hi"]`` was served; a batch of more stays a 400."""
    with _client(model_dir) as c:
        one = _complete(c, headers={}, prompt=[[104, 105]], temperature=0)
        assert one.status_code == 200, one.text
        assert one.json()["choices"] == _complete(c, headers={}, prompt="hi", temperature=0).json()["choices"]
        for bad in ([[104], [105]], [[]], [["hi"]], [[104, 999]]):
            r = _complete(c, headers={}, prompt=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


def test_the_bearer_scheme_is_matched_in_any_case(model_dir):
    """RFC 9110 11.1: the auth scheme is case-insensitive (and RFC 6750 allows spaces before the token): "bearer
    s3cret" was a 401, the whole header being compared to "Bearer s3cret"."""
    with _client(model_dir, api_key="s3cret") as c:
        for header in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("bearer S3CRET", "Basic s3cret", "Bearer", "Bearers3cret", "bearer s3cret2"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 401, header


BAD = [
    ({"model": "tiny@T7"}, 400, "not served here"),
    ({"model": "other"}, 404, "unknown model"),
    ({"model": "tiny@"}, 400, "names no tier after '@'"),
    ({"tier": "T99"}, 400, "not served here"),
    ({"model": "tiny@T1", "tier": "T10"}, 400, "disagree"),
    ({"max_tokens": -1}, 400, "max_tokens must be an integer"),
    ({"max_tokens": 2.5}, 400, "max_tokens must be an integer"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": 3}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"seed": "x"}, 400, "seed"),
    ({"n": 2}, 400, "n must be 1"),
    ({"n": 1.0}, 400, "n must be 1"),
    ({"n": True}, 400, "n must be 1"),
    ({"logprobs": 3}, 400, "logprobs is not supported"),
    ({"logprobs": 0}, 400, "logprobs is not supported"),          # 0: the sampled tokens' log-probabilities
    ({"top_logprobs": 2}, 400, "top_logprobs is not supported"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format is not supported"),
    ({"echo": 1}, 400, "echo is not supported"),
    ({"tool_choice": "required"}, 400, "tool_choice is not supported"),      # were ignored: text came back
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice is not supported"),
    ({"function_call": {"name": "f"}}, 400, "function_call is not supported"),
    ({"modalities": ["text", "audio"]}, 400, "modalities is not supported"),
    ({"stop": ["a"] * 5}, 400, "stop must be"),
    ({"stream": "yes"}, 400, "stream must be"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": ["a", "b"]}, 400, "one request each"),
    ({"prompt": [1, 999]}, 400, "token ids must lie"),
    ({"prompt": None}, 400, "prompt must be"),
    ({"stream_options": {"include_usage": True}}, 400, "only allowed with stream: true"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "include_usage must be true or false"),
    ({"stream": True, "stream_options": [1]}, 400, "stream_options must be an object"),
]


def test_bad_requests_get_400_and_the_server_keeps_answering(model_dir):
    with _client(model_dir) as c:
        for fields, status, words in BAD:
            r = _complete(c, headers={}, **fields)
            assert r.status_code == status, (fields, r.text)
            assert words in r.json()["error"]["message"], (fields, r.text)
        raw = [b"{not json", b"[1, 2]", b'"text"', b'{"prompt": "\xff\xfe"}', b"[" * 3000,
               b'{"prompt": "\\ud800 lone surrogate"}']
        for body in raw:
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 400 and "\n" not in r.json()["error"]["message"], (body[:20], r.text)
        chat = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
        assert _complete(c, headers={}, prompt=[104, 105], temperature=0).status_code == 200
        asks_nothing = {"logprobs": False, "echo": False, "best_of": 1, "top_logprobs": 0,
                        "response_format": {"type": "text"}, "logit_bias": {}, "tool_choice": "auto",
                        "function_call": "none", "modalities": ["text"]}
        assert _complete(c, headers={}, prompt=[104, 105], temperature=0, **asks_nothing).status_code == 200
        c.app.state.engine.submit = lambda req: (_ for _ in ()).throw(Busy("tier T10 is at capacity"))
        full = _complete(c, headers={})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"

        def engine_gone(req):         # the engine process ended with the request in flight (remote._engine_died)
            req.finish_reason = "error"
            req.queue.put_nowait(("unavailable", "the server is shutting down"))

        c.app.state.engine.submit = engine_gone
        gone = _complete(c, headers={})
        assert gone.status_code == 503 and gone.headers["retry-after"] == "1", gone.text
        assert gone.json()["error"]["message"] == "the server is shutting down"
        streamed = _complete(c, headers={}, stream=True)
        assert '"code": 503' in streamed.text and "data: [DONE]" in streamed.text
        metrics = c.get("/metrics").text
        assert 'elastic_ssm_requests_total{status="200",tier="T10"} 2' in metrics
        assert 'elastic_ssm_requests_total{status="503",tier="T10"} 3' in metrics
        assert 'elastic_ssm_slots{tier="T1"} 2' in metrics
        assert 'elastic_ssm_rejected_total{reason="http_400"}' in metrics
        counters = {}                                           # the engine loop's counters, one line each
        for name in COUNTERS:
            (line,) = [x for x in metrics.splitlines() if x.startswith(f"elastic_ssm_{name}_total ")]
            counters[name] = float(line.split()[1])
        assert counters["decode_steps"] > 0 and counters["prefill_forwards"] > 0 and min(counters.values()) >= 0


def test_streamed_usage_comes_last_when_asked_for(model_dir):
    """``stream_options.include_usage``: one more chunk with empty ``choices`` and the counts, then [DONE];
    without it the stream ends at the finish chunk."""
    with _client(model_dir) as c:
        assert _complete(c, headers={}, stream_options={}).status_code == 200       # empty: let through, as vLLM
        for usage in (True, False):
            r = _complete(c, headers={}, stream=True, stream_options={"include_usage": usage}, temperature=0)
            events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1 - usage]["choices"][0]["finish_reason"] == "length"
            if usage:
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
                    "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
            assert all("usage" not in ch or ch["usage"] is None for ch in chunks[:len(chunks) - usage])


def test_seeded_sampling_repeats_and_auto_tier_reports_the_tier(model_dir):
    with _client(model_dir) as c:
        a = _complete(c, headers={}, temperature=1.0, top_p=0.9, top_k=20, seed=7, max_tokens=12).json()
        b = _complete(c, headers={}, temperature=1.0, top_p=0.9, top_k=20, seed=7, max_tokens=12).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        auto = _complete(c, headers={}, tier="auto", temperature=0).json()
        assert auto["tier"] == "T10" and auto["model"] == "tiny@T10"    # nothing else running: no downgrade


def test_chat_completions_through_the_saved_chat_template(model_dir, tmp_path):
    import shutil

    path = tmp_path / "chatty"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with _client(path) as c:
        body = {"model": "tiny@T1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
        assert out["usage"]["prompt_tokens"] == len("<user>hello\n<assistant>")
        lines = [json.loads(line[6:]) for line in c.post("/v1/chat/completions", json={**body, "stream": True})
                 .text.splitlines() if line.startswith("data: {")]
        assert lines[0]["object"] == "chat.completion.chunk" and lines[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in x["choices"][0]["delta"] for x in lines[1:])    # text may come in one chunk
        assert "".join(x["choices"][0]["delta"].get("content", "") for x in lines) == \
            out["choices"][0]["message"]["content"] and lines[-1]["choices"][0]["finish_reason"] == "length"
        bad = c.post("/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
        assert bad.status_code == 400 and "messages must be" in bad.json()["error"]["message"]
        long = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x" * 100}]})
        error = long.json()["error"]          # the client sent messages, not a prompt: the error names them
        assert long.status_code == 400 and error["param"] == "messages", long.text
        assert error["message"].startswith("messages, as the chat template renders them: prompt has 118 tokens")


def test_a_streamed_chat_without_text_names_the_role_for_the_openai_client(model_dir):
    """A stream whose generation yields no text (a stop string at its first character) sent no chunk with
    ``delta.role``, so the openai client's stream accumulator built a message of role None; the first chunk now
    names it, as OpenAI's does."""
    pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    with _client(model_dir, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as c:
        body = {"model": "tiny@T1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                "temperature": 0}
        text = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        for stop, want in ((text[0], ""), (None, text)):
            r = c.post("/v1/chat/completions", json={**body, "stream": True, "stop": stop})
            state = ChatCompletionStreamState()
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    state.handle_chunk(ChatCompletionChunk.model_validate_json(line[6:]))
            message = state.current_completion_snapshot.choices[0].message
            assert (message.role, message.content) == ("assistant", want), stop


def test_a_running_server_keeps_its_start_up_objects_out_of_full_collections(model_dir):
    """``gc.freeze`` at start (a full collection over the model and modules paused a server ~130 ms); undone at stop."""
    import gc

    with _client(model_dir) as c:
        assert c.get("/health").status_code == 200
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("chat", [False, True])
def test_a_streamed_text_event_is_the_json_of_its_whole_chunk(chat):
    """The per-token fast path (chunk rendered once around a marker) gives the bytes ``json.dumps`` of the whole
    chunk gives, for texts JSON must escape; for chat after the first chunk (which names the role)."""
    from types import SimpleNamespace

    from elastic_ssm.serve.app import _text_event
    from elastic_ssm.serve.schema import response_body

    req = SimpleNamespace(id="cmpl-1", created=1700000000.0, tier="T4", prompt=[1, 2], completion_tokens=3,
                          role_sent=False)
    render = lambda text, finish: response_body(req, "m@T4", chat, text, finish, stream=True)  # noqa: E731
    if chat:
        render("first", None)
    event = _text_event(render)
    for text in ["a", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00nul\x1f", "é ü 中文 🙂", "\u2028"]:
        assert event(text) == f"data: {json.dumps(render(text, None))}\n\n", text


def _with_template(model_dir, tmp_path, template):
    import shutil

    path = tmp_path / "templated"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_chat_template_special_tokens_are_their_ids_as_in_apply_chat_template(model_dir, tmp_path):
    """``{{ bos_token }}`` (and any special-token string the template writes) is one id, not its characters'
    bytes: the prompt ids equal transformers' ``apply_chat_template``'s."""
    from elastic_ssm.data.tokenizers import resolve_tokenizer
    from elastic_ssm.serve.schema import ChatMessage
    from elastic_ssm.serve.tokens import ChatTemplate

    template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}<sep>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = _with_template(model_dir, tmp_path, template)
    model = es.ESSH.from_pretrained(path)
    chat = ChatTemplate.from_model(model, resolve_tokenizer(model))
    messages = [{"role": "user", "content": "hi"}]
    ids = chat.prompt([ChatMessage.model_validate(m) for m in messages])
    assert ids == [257, *b"<user>hi", 259, *b"<assistant>"]          # <bos> = 257, <sep> = 259 (byte tokenizer)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(path)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ids == list(expected)
    with _client(path) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_template_raise_exception_refuses_with_the_templates_message(model_dir, tmp_path):
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('Only user and assistant roles are supported, got ' + m.role) }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    with _client(_with_template(model_dir, tmp_path, template)) as c:
        bad = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                   "messages": [{"role": "system", "content": "x"}]})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        assert err["message"] == ("the chat template refused these messages: Only user and assistant roles are "
                                  "supported, got system")
        ok = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 1


def test_unknown_paths_and_methods_answer_in_the_openai_error_shape(model_dir):
    with _client(model_dir) as c:
        r = c.get("/v1/nothing")
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["type"] == "not_found_error" and err["code"] == 404 and "/v1/nothing" in err["message"]
        assert "detail" not in r.json()
        r = c.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        err = r.json()["error"]
        assert err["code"] == 405 and err["message"] == "GET is not allowed on /v1/completions; use POST"
        assert err["type"] == "invalid_request_error"         # was "error", no type of OpenAI's (so were 408, 421)
        misdirected = c.get("/v1/models", headers={"Host": "evil.example"}).json()["error"]
        assert (misdirected["code"], misdirected["type"]) == (421, "invalid_request_error")
        r = c.head("/health")                                 # a load balancer's probe: the status, no body
        assert r.status_code == 200 and r.content == b""


def test_chat_content_may_be_a_list_of_text_parts_as_openai_clients_send(model_dir, tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    with _client(_with_template(model_dir, tmp_path, template)) as c:
        def chat(content):
            return c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "temperature": 0,
                                                        "messages": [{"role": "user", "content": content}]})

        plain = chat("hello there")
        parts = chat([{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}])
        assert plain.status_code == parts.status_code == 200, parts.text
        assert parts.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
        assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        image = chat([{"type": "image_url", "image_url": {"url": "http://x"}}])
        assert image.status_code == 400 and "'image_url' part" in image.json()["error"]["message"]
        for bad in (7, [], [{"type": "text"}], None):
            r = chat(bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (bad, r.text)
