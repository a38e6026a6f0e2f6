"""Chat templates (docs/serving.md, "Chat"): ``ChatTemplate`` renders and encodes messages as
``apply_chat_template`` does; ``chat_template_source`` reads ``--chat_template`` (a ``BUILTIN`` name or a file)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..utils.files import read_json
from .schema import ApiError

__all__ = ["BUILTIN", "chat_template_source", "ChatTemplate", "default_template", "special_token_ids"]

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
        ChatTemplate(text, {})
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ConfigError(f"--chat_template {spec}: not a valid Jinja template{where}: {e.message}") from None
    return text


def default_template(saved: Any) -> Any:
    """A saved ``chat_template``: a string, or transformers' list of named ones, of which ``default`` is used."""
    if isinstance(saved, list):
        return next((t.get("template") for t in saved if isinstance(t, dict) and t.get("name") == "default"), None)
    return saved


def special_token_ids(path: Path, specials: dict[str, str], tokenizer: Any = None) -> dict[str, int]:
    """Special-token text -> id: ``tokenizer.json``'s special ``added_tokens``, and the ``specials``
    (``bos_token`` -> ``"<bos>"``) of the roles ``tokenizer`` has ids for (``bos_id``, ``eos_id``, ...)."""
    out: dict[str, int] = {}
    record = read_json(path / "tokenizer.json")
    added = record.get("added_tokens") if isinstance(record, dict) else []
    for t in added if isinstance(added, list) else []:
        if isinstance(t, dict) and t.get("special") and isinstance(t.get("content"), str) and t["content"] \
                and isinstance(t.get("id"), int):
            out[t["content"]] = t["id"]
    for key, text in specials.items():
        tid = getattr(tokenizer, key.removesuffix("_token") + "_id", None)
        if text and text not in out and isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0:
            out[text] = tid
    return out


class ChatTemplate:
    """A compiled chat template. ``specials``: its special-token variables; ``prompt`` encodes a rendering with
    ``tokenizer`` as ``apply_chat_template`` does (each ``special_ids`` string one id)."""

    def __init__(self, source: str, specials: dict[str, str], tokenizer: Any = None,
                 special_ids: dict[str, int] | None = None) -> None:
        import jinja2.ext
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: Any) -> None:     # the globals transformers gives chat templates
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
        self.template, self.specials = env.from_string(source), specials
        self.tokenizer = tokenizer
        self.special_ids = {k: int(v) for k, v in (special_ids or {}).items() if k}
        # longest first, so that a special token containing another is matched whole
        alternatives = sorted(self.special_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    @classmethod
    def from_model(cls, model, tokenizer: Any = None, source: str | None = None) -> ChatTemplate | None:
        """``source`` or the directory's template (``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, as transformers reads them), specials from ``tokenizer_config.json``; None: none."""
        path = getattr(model, "name_or_path", None)
        cfg = Path(path) / "tokenizer_config.json" if path else None
        meta = read_json(cfg) if cfg is not None else {}
        meta = meta if isinstance(meta, dict) else {}
        jinja = Path(path) / "chat_template.jinja" if path else None     # where transformers saves it now
        origin = "--chat_template"
        if source is None and jinja is not None and jinja.is_file():
            origin, source = jinja, jinja.read_text(encoding="utf-8")
        elif source is None:                     # a model without a directory (random weights): no template
            origin, source = cfg, default_template(meta.get("chat_template"))
        if not isinstance(source, str) or not source.strip():
            return None
        specials = {}
        for k, v in meta.items():             # "<bos>", or an AddedToken record {"content": "<bos>", ...}
            v = v.get("content") if isinstance(v, dict) else v
            if k.endswith("_token") and isinstance(v, str):
                specials[k] = v
        from jinja2 import TemplateError

        try:
            return cls(source, specials, tokenizer, special_token_ids(Path(path), specials, tokenizer) if path else {})
        except TemplateError as e:       # the directory's own (--chat_template's was compiled when read)
            raise ConfigError(f"the chat template of {origin} is not a valid Jinja template (line {e.lineno}): "
                              f"{e.message}; fix it, or replace it with --chat_template chatml (or plain, or a "
                              "Jinja file)") from None

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
            prompt = self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except Exception as e:   # a template error (e.g. raise_exception on a role order) is the request's fault
            text = " ".join(str(e).split())[:200] or type(e).__name__     # it may quote a message
            raise ApiError(400, f"the chat template refused these messages: {text}", "messages") from None
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(prompt) if self._split is not None else [prompt]):
            if i % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids += list(self.tokenizer.encode(piece))
        return ids if ids else prompt
