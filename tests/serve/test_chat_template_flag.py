"""Chat out of the box (issue 41 item 3): ``serve --chat_template chatml|plain|FILE`` gives a model without a saved
template one (or replaces its own), rendered as any template is; without one the 400 names the flag; a bad name,
file or template stops the start in one line."""

import json
import shutil

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import elastic_ssm as es  # noqa: E402
from elastic_ssm.cli import main  # noqa: E402
from elastic_ssm.config import ConfigError  # noqa: E402
from elastic_ssm.serve.app import ServerSettings, create_app  # noqa: E402
from elastic_ssm.serve.tokens import BUILTIN, chat_template_source  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f"}]


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir                        # tests/serve/conftest.py: a saved tiny model with the byte tokenizer


def _client(path, template=None):
    settings = ServerSettings(name="tiny", tiers=["T10"], default_tier="T10", slots=2, chat_template=template,
                              allowed_hosts=("testserver",))          # TestClient's Host
    return TestClient(create_app(es.ESSH.from_pretrained(path), settings))


def test_without_a_template_the_400_names_the_flag(model_dir):
    with _client(model_dir) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 400 and "--chat_template" in r.json()["error"]["message"]


def test_a_template_saved_by_transformers_in_the_directory_is_used(model_dir, tmp_path):
    """transformers' ``tokenizer.save_pretrained`` writes ``chat_template.jinja`` beside ``tokenizer_config.json``
    (which then holds none), and ``apply_chat_template`` reads it; the server said "this model has no chat template"."""
    path = tmp_path / "saved"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n"
                                              "{% endfor %}bot>")
    with _client(path) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(b"system> Be brief.\nuser> def f\nbot>")


@pytest.mark.parametrize("name, rendered", [
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef f<|im_end|>\n<|im_start|>assistant\n"),
    ("plain", "System: Be brief.\nUser: def f\nAssistant:")])
def test_a_named_template_renders_the_messages_into_the_prompt_the_model_completes(model_dir, name, rendered):
    with _client(model_dir, chat_template_source(name)) as c:
        chat = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 6,
                                                    "temperature": 0})
        plain = c.post("/v1/completions", json={"model": "tiny", "prompt": rendered, "max_tokens": 6,
                                                "temperature": 0})
    assert chat.status_code == 200 and plain.status_code == 200, (chat.text, plain.text)
    assert chat.json()["usage"]["prompt_tokens"] == len(rendered.encode())        # the byte tokenizer: one per byte
    assert chat.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]


def test_a_file_replaces_the_directorys_own_template(model_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>")
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "{{ 'never used' }}"}))
    assert chat_template_source(str(template)) == template.read_text()
    assert chat_template_source(str(cfg)) == "{{ 'never used' }}"        # a tokenizer_config.json works too
    with _client(model_dir, chat_template_source(str(template))) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("[system] Be brief.\n[user] def f\n>")


@pytest.mark.parametrize("write, needle", [
    (None, "neither a file nor one of chatml, plain"),
    ("", "is empty"),
    ("{% for m in messages %}", "not a valid Jinja template"),
    (b"\xff\xfe", "UTF-8"),
])
def test_a_bad_template_stops_the_start_in_one_line(model_dir, tmp_path, capsys, write, needle):
    spec = tmp_path / "t.jinja"
    if write is not None:
        spec.write_bytes(write if isinstance(write, bytes) else write.encode())
    with pytest.raises(ConfigError, match=needle):
        chat_template_source(str(spec))
    assert main(["serve", str(model_dir), "--chat_template", str(spec), "--device", "cpu", "--port", "0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--chat_template" in err[0] and needle in err[0], err


def test_a_list_of_named_templates_uses_the_default_one(model_dir, tmp_path):
    """tokenizer_config.json may hold transformers' list of named templates ({"name", "template"}); transformers
    renders the "default" one, the server said the model had none (and --chat_template refused the file)."""
    path = tmp_path / "named"
    shutil.copytree(model_dir, path)
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    cfg = {**json.loads((path / "tokenizer_config.json").read_text()), "chat_template": named}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert chat_template_source(str(path / "tokenizer_config.json")) == "{{ messages[0]['content'] }}!"
    with _client(path) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(b"Be brief.!")


def test_a_broken_template_in_the_directory_stops_the_start_in_one_line_naming_the_file(model_dir, tmp_path):
    """The directory's own template that Jinja cannot compile was "unexpected TemplateSyntaxError ... probably a bug";
    it is named with its file and the flag that replaces it, which then serves."""
    path = tmp_path / "broken"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}"}))
    with pytest.raises(ConfigError, match=r"chat template of .*tokenizer_config.json is not a valid Jinja template "
                                          r"\(line 1\): .*; fix it, or replace it with --chat_template"):
        _client(path)
    with _client(path, chat_template_source("plain")) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_names_are_the_documented_ones():
    assert set(BUILTIN) == {"chatml", "plain"}
