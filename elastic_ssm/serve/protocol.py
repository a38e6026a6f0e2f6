"""The OpenAI API rules that ``schema.py`` cannot say (tier names, prompt limits), its response bodies, and the
chat template; a refusal is an ``ApiError`` answered in OpenAI's error shape (docs/serving.md, "The API", "Chat")."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["ApiError", "error_body", "resolve_model_field", "parse_prompt", "completion_body", "chunk_body",
           "ChatTemplate", "special_token_ids"]


class ApiError(Exception):
    """A refused request: HTTP ``status`` and a one-line ``message`` (``param``: the field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 415: "invalid_request_error", 431: "invalid_request_error",
            429: "rate_limit_error", 500: "server_error", 503: "server_overloaded"}.get(status, "error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def resolve_model_field(model: str | None, extra: str | None, name: str, tiers: list[str], default_tier: str,
                        aliases: dict[str, str] | None = None) -> str:
    """The tier a request names by ``model`` and/or ``tier``; ``aliases``: other names -> served tiers."""
    picked = None
    if model is not None:
        base, at, tier = model.partition("@")
        if at and not tier.strip():
            raise ApiError(400, f"model {model!r} names no tier after '@'; give '{name}' for the default tier or "
                                f"one of {', '.join(f'{name}@{t}' for t in tiers)}", "model")
        if base != name:
            raise ApiError(404, f"unknown model {model!r}; this server serves {name!r} "
                                f"(tiers: {', '.join(f'{name}@{t}' for t in tiers)})", "model")
        picked = tier or None
    if extra is not None:
        if picked is not None and picked.upper() != extra.upper():
            raise ApiError(400, f"model {model!r} and tier {extra!r} disagree; give one of them", "tier")
        picked = extra
    if picked is None:
        return default_tier
    if picked.lower() == "auto":
        return "auto"
    for t in [*tiers, *(aliases or {})]:
        if t.upper() == picked.upper():
            return (aliases or {}).get(t, t)
    raise ApiError(400, f"tier {picked!r} is not served here; served tiers: {', '.join(tiers)} (or 'auto')", "tier")


def parse_prompt(prompt: str | list, tokenizer, vocab: int, max_prompt: int) -> list[int]:
    """A validated ``prompt`` (``schema.CompletionRequest``) as token ids, within the vocabulary and the limit."""
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "prompt is not valid UTF-8 text (it holds an unpaired surrogate)", "prompt") from None
        ids = tokenizer.encode(prompt)
    elif not all(0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
    else:
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt is empty: give at least one character", "prompt")
    if len(ids) > max_prompt:
        raise ApiError(400, f"prompt has {len(ids)} tokens; this server takes at most {max_prompt}", "prompt")
    return ids


def _body(req, model_id: str, kind: str, choice: dict | None, usage: bool) -> dict:
    """A response body of object ``kind`` with ``choice`` (None: no choices) and, with ``usage``, the counts."""
    body = {"id": req.id.replace("cmpl", "chatcmpl") if kind.startswith("chat") else req.id, "object": kind,
            "created": int(req.created or time.time()), "model": model_id, "tier": req.tier,
            "choices": [] if choice is None else [{"index": 0, **choice}]}
    if usage:
        n, m = len(req.prompt), req.completion_tokens
        body["usage"] = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
    return body


def completion_body(req, model_id: str, text: str) -> dict:
    """The non-streamed response of a finished request."""
    choice = {"text": text, "logprobs": None, "finish_reason": req.finish_reason}
    return _body(req, model_id, "text_completion", choice, True)


def chunk_body(req, model_id: str, text: str, finish_reason: str | None, usage: bool = False) -> dict:
    """One streamed chunk (``usage``: the last, empty-choices chunk carrying the counts)."""
    choice = None if usage else {"text": text, "logprobs": None, "finish_reason": finish_reason}
    return _body(req, model_id, "text_completion", choice, usage)


def special_token_ids(path: Path, specials: dict[str, str], tokenizer: Any = None) -> dict[str, int]:
    """Special-token text -> id: ``tokenizer.json``'s special ``added_tokens``, and the ``specials``
    (``bos_token`` -> ``"<bos>"``) of the roles ``tokenizer`` has ids for (``bos_id``, ``eos_id``, ...)."""
    out: dict[str, int] = {}
    try:
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError, AttributeError):
        added = []
    for t in added if isinstance(added, list) else []:
        if isinstance(t, dict) and t.get("special") and isinstance(t.get("content"), str) and t["content"] \
                and isinstance(t.get("id"), int):
            out[t["content"]] = t["id"]
    for key, text in specials.items():
        tid = getattr(tokenizer, key.removesuffix("_token") + "_id", None)
        if text and text not in out and isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0:
            out[text] = tid
    return out


def text_content(content, index: int) -> str:
    """A chat message's ``content`` as text: a string, or its ``text`` parts joined (another part is a 400)."""
    if isinstance(content, str):
        return content
    other = next((part.type for part in content if part.type != "text"), None)
    if other is not None:
        raise ApiError(400, f"messages[{index}].content has a {other!r} part; this model reads text only "
                       "(content parts of type 'text')", "messages")
    if any(part.text is None for part in content):
        raise ApiError(400, f"messages[{index}].content has a text part without its text", "messages")
    return "".join(part.text for part in content)


class ChatTemplate:
    """A compiled chat template and OpenAI's chat response shapes. ``specials``: its special-token variables; with a
    ``tokenizer`` a rendered prompt is encoded as ``apply_chat_template`` does (each ``special_ids`` string one id)."""

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
        self._split = None
        if self.special_ids:
            import re

            # longest first, so that a special token containing another is matched whole
            alternatives = sorted(self.special_ids, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")

    @classmethod
    def from_model(cls, model, tokenizer: Any = None, source: str | None = None) -> ChatTemplate | None:
        """The directory's template or ``source``, specials from ``tokenizer_config.json``; None: none."""
        path = getattr(model, "name_or_path", None)
        cfg = Path(path) / "tokenizer_config.json" if path else None
        try:
            meta = json.loads(cfg.read_text()) if cfg is not None and cfg.is_file() else {}
        except (OSError, json.JSONDecodeError):
            meta = {}
        meta = meta if isinstance(meta, dict) else {}
        if source is None:
            source = meta.get("chat_template")
        if not isinstance(source, str) or not source.strip():
            return None
        specials = {}
        for k, v in meta.items():             # "<bos>", or an AddedToken record {"content": "<bos>", ...}
            v = v.get("content") if isinstance(v, dict) else v
            if k.endswith("_token") and isinstance(v, str):
                specials[k] = v
        return cls(source, specials, tokenizer, special_token_ids(Path(path), specials, tokenizer) if path else {})

    def encode(self, prompt: str) -> list[int] | str:
        """The rendered prompt's token ids (special tokens as their ids), or the text without a tokenizer."""
        if self.tokenizer is None:
            return prompt
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(prompt) if self._split is not None else [prompt]):
            if i % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids += list(self.tokenizer.encode(piece))
        return ids if ids else prompt          # an empty prompt: parse_prompt's own message

    def prompt(self, messages: list) -> list[int] | str:
        """The prompt of validated chat ``messages`` (``schema.ChatMessage``): rendered, then encoded."""
        messages = [{**m.model_dump(), "content": text_content(m.content, i)} for i, m in enumerate(messages)]
        try:
            prompt = self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except Exception as e:   # a template error (e.g. raise_exception on a role order) is the request's fault
            text = " ".join(str(e).split()) or type(e).__name__
            raise ApiError(400, f"the chat template refused these messages: {text}", "messages") from None
        try:                     # the tokenizer encodes it as UTF-8 (parse_prompt checks a completion's prompt)
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "messages hold text that is not valid UTF-8 (an unpaired surrogate)",
                           "messages") from None
        return self.encode(prompt)

    @staticmethod
    def completion_body(req, model_id: str, text: str) -> dict:
        choice = {"message": {"role": "assistant", "content": text}, "finish_reason": req.finish_reason}
        return _body(req, model_id, "chat.completion", choice, True)

    @staticmethod
    def chunk_body(req, model_id: str, text: str, finish_reason: str | None, usage: bool = False) -> dict:
        if usage:
            return _body(req, model_id, "chat.completion.chunk", None, True)
        delta = {"content": text} if text else {}
        if text and not req.role_sent:                   # the first text chunk names the role
            delta["role"], req.role_sent = "assistant", True
        return _body(req, model_id, "chat.completion.chunk", {"delta": delta, "finish_reason": finish_reason}, False)
