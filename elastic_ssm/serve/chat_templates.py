"""Chat templates (docs/serving.md, "Chat"): ``ChatTemplate`` renders and encodes messages by transformers'
``apply_chat_template``; ``chat_template_source`` reads ``--chat_template`` (a ``BUILTIN`` name or a file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..utils.files import read_json
from .schema import ApiError

__all__ = ["BUILTIN", "chat_template_source", "ChatTemplate", "compiled", "default_template"]

BUILTIN = {
    "chatml": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "plain": ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"),
}
#: the largest template file read (a template is a few hundred bytes; a wrong path should not read a dataset)
MAX_BYTES = 1 << 18


def chat_template_source(spec: str | None) -> str | None:
    """The Jinja source ``spec`` names (None: None): a built-in name (``BUILTIN``) or a template file (UTF-8 text, or
    a JSON ``tokenizer_config.json`` whose ``chat_template`` is taken), compiled once here so that a broken one
    stops ``serve`` before the model loads, in a one-line ``ConfigError``."""
    if spec is None or spec in BUILTIN:
        return BUILTIN.get(spec)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--chat_template {spec!r} is neither a file nor one of {', '.join(BUILTIN)}; give a Jinja "
                          "template file or a name")
    if path.stat().st_size > MAX_BYTES:
        raise ConfigError(f"--chat_template {spec}: {path.stat().st_size:,} bytes, more than a template holds "
                          f"({MAX_BYTES:,} at most); give the template file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat_template {spec}: cannot read it as UTF-8 text ({e})") from None
    if path.suffix == ".json":
        try:
            text = default_template(json.loads(text)["chat_template"])
        except (ValueError, KeyError, TypeError):
            text = None
        if not isinstance(text, str):
            raise ConfigError(f"--chat_template {spec}: a JSON file must hold a string 'chat_template' (as "
                              "tokenizer_config.json does)")
    if not text.strip():
        raise ConfigError(f"--chat_template {spec} is empty; give a Jinja template")
    from jinja2 import TemplateError

    try:
        compiled(text)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ConfigError(f"--chat_template {spec}: not a valid Jinja template{where}: {e.message}") from None
    return text


def default_template(saved: Any) -> Any:
    """A saved ``chat_template``: a string, or transformers' list of named ones, of which ``default`` is used."""
    if isinstance(saved, list):
        return next((t.get("template") for t in saved if isinstance(t, dict) and t.get("name") == "default"), None)
    return saved


def compiled(source: str) -> Any:
    """``source`` compiled in the Jinja sandbox transformers renders chat templates in (a ``TemplateError`` when Jinja
    cannot compile it)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)


class ChatTemplate:
    """A chat template and the tokenizer of a served model as ``transformers`` holds it; ``prompt`` renders and
    encodes messages by its ``apply_chat_template`` (every special-token string of the rendering is that token's
    id)."""

    def __init__(self, source: str, tokenizer: Any) -> None:
        from transformers import PreTrainedTokenizerFast

        from ..data.tokenizers import SPECIAL_ROLES, ByteTokenizer, byte_level_tokenizer

        inner = byte_level_tokenizer() if isinstance(tokenizer, ByteTokenizer) else tokenizer._tok
        specials = {f"{r}_token": inner.id_to_token(getattr(tokenizer, f"{r}_id")) for r in SPECIAL_ROLES}
        self.source, self.hf = source, PreTrainedTokenizerFast(tokenizer_object=inner, **specials)

    @classmethod
    def from_model(cls, model, tokenizer: Any = None, source: str | None = None) -> ChatTemplate | None:
        """``source`` or the directory's template (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, as transformers reads them); None: none."""
        path = getattr(model, "name_or_path", None)
        cfg = Path(path) / "tokenizer_config.json" if path else None
        meta = read_json(cfg) if cfg is not None else {}
        jinja = Path(path) / "chat_template.jinja" if path else None     # where transformers saves it now
        origin = "--chat_template"
        if source is None and jinja is not None and jinja.is_file():
            origin, source = jinja, jinja.read_text(encoding="utf-8")
        elif source is None:                     # a model without a directory (random weights): no template
            origin, source = cfg, default_template(meta.get("chat_template") if isinstance(meta, dict) else None)
        if not isinstance(source, str) or not source.strip():
            return None
        from jinja2 import TemplateError

        try:
            compiled(source)
        except TemplateError as e:       # the directory's own (--chat_template's was compiled when read)
            raise ConfigError(f"the chat template of {origin} is not a valid Jinja template (line {e.lineno}): "
                              f"{e.message}; fix it, or replace it with --chat_template chatml (or plain, or a "
                              "Jinja file)") from None
        return cls(source, tokenizer)

    def prompt(self, messages: list) -> list[int] | str:
        """The token ids of validated chat ``messages`` (``schema.ChatMessage``: text content) as rendered, special
        tokens as their ids (an empty rendering: its text, for ``parse_prompt``'s own message)."""
        messages = [m.model_dump() for m in messages]
        try:     # before rendering: the tokenizer encodes UTF-8, and a template's refusal may quote the messages
            json.dumps(messages, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "messages hold text that is not valid UTF-8 (an unpaired surrogate)",
                           "messages") from None
        try:
            ids = self.hf.apply_chat_template(messages, chat_template=self.source, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        except Exception as e:   # a template error (e.g. raise_exception on a role order) is the request's fault
            text = " ".join(str(e).split())[:200] or type(e).__name__     # it may quote a message
            raise ApiError(400, f"the chat template refused these messages: {text}", "messages") from None
        return list(ids) or ""
