"""The OpenAI completions API as this server reads and writes it: request validation and response bodies.

``parse_completion(body, ...)`` turns a decoded JSON body into the fields of an engine ``Request`` or raises
``ApiError`` (status and a one-line message; the HTTP layer answers with OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``). Fields read: ``model`` (``name`` = the default tier,
``name@T4`` a tier, ``name@auto`` the tier chosen under load), an extra ``tier`` (same values; it must
agree with ``model``), ``prompt`` (a string, a list of one string, or a list of token ids), ``max_tokens``
(default 16, as OpenAI's), ``temperature`` (default 1; 0 = greedy), ``top_p``, ``top_k`` (extension,
0 or -1 = off), ``stop`` (a string or up to 4), ``seed``, ``stream``, ``stream_options.include_usage``,
``n`` (1 only), ``user`` (ignored). Fields the server cannot honour (``logprobs``, ``top_logprobs``, ``echo``,
``best_of``, ``suffix``, ``logit_bias``, ``tools``, a ``response_format`` other than text, penalties other than
0) are a 400, never silently dropped.

Chat: Chat completions through the tokenizer's chat template, when the model directory has one.

A model directory's ``tokenizer_config.json`` may carry a Jinja ``chat_template`` (Hugging Face's field).
``ChatTemplate.from_model(model)`` reads it (None when there is none: ``/v1/chat/completions`` then
answers 400). The template is rendered in Jinja's immutable sandbox with ``messages``,
``add_generation_prompt=True``, the tokenizer's special tokens (``bos_token`` ...) and transformers' helpers
``raise_exception`` (a template's refusal: a 400 carrying its message) and ``strftime_now``. The prompt is then
encoded as transformers' ``apply_chat_template`` encodes it: each special-token string (``<bos>``, any
``added_tokens`` entry marked special in the saved ``tokenizer.json``) becomes its id, the text between them
goes through the tokenizer (as there, such a string inside a message's content is that special token too);
the request then runs as a completion of those ids. Answers take OpenAI's chat shapes (``chat.completion``
with a ``message``; ``chat.completion.chunk`` with a ``delta`` when streamed).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ApiError", "CompletionParams", "parse_completion", "completion_body", "chunk_body", "error_body",
           "ChatTemplate", "special_token_ids"]


class ApiError(Exception):
    """A refused request: HTTP ``status`` and a one-line ``message`` (``param``: the field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}.get(status, "error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class CompletionParams:
    tier: str                  # a served tier name, or "auto"
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo \
            or (lo_open and v == lo):
        bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise ApiError(400, f"{key} must be a number in {bound}, got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def resolve_model_field(body: dict, name: str, tiers: list[str], default_tier: str,
                        aliases: dict[str, str] | None = None) -> str:
    """The tier a request names through ``model`` and/or ``tier``; ``aliases`` maps other names to served tiers
    (an older export's source tier name, ``models.base.export_tier_aliases``)."""
    model, extra = body.get("model"), body.get("tier")
    picked = None
    if model is not None:
        if not isinstance(model, str):
            raise ApiError(400, f"model must be a string such as {name!r} or '{name}@{tiers[0]}'", "model")
        base, at, tier = model.partition("@")
        if at and not tier.strip():
            raise ApiError(400, f"model {model!r} names no tier after '@'; give '{name}' for the default tier or "
                                f"one of {', '.join(f'{name}@{t}' for t in tiers)}", "model")
        if base != name:
            raise ApiError(404, f"unknown model {model!r}; this server serves {name!r} "
                                f"(tiers: {', '.join(f'{name}@{t}' for t in tiers)})", "model")
        picked = tier or None
    if extra is not None:
        if not isinstance(extra, str):
            raise ApiError(400, f"tier must be a string: one of {', '.join(tiers)} or 'auto'", "tier")
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


def parse_prompt(prompt: Any, tokenizer, vocab: int, max_prompt: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "prompt is not valid UTF-8 text (it holds an unpaired surrogate)", "prompt") from None
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids "
                            "(batched prompts: send one request each)", "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty: give at least one character", "prompt")
    if len(ids) > max_prompt:
        raise ApiError(400, f"prompt has {len(ids)} tokens; this server takes at most {max_prompt}", "prompt")
    return ids


#: fields the server cannot honour, each with the values that ask nothing of it (compared type and value:
#: ``logprobs: 0`` asks for the sampled tokens' log-probabilities, ``false`` for none)
_UNSUPPORTED: dict[str, tuple] = {"logprobs": (None, False), "echo": (None, False), "best_of": (None, 1),
                                  "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
                                  "functions": (None, []), "top_logprobs": (None, 0),
                                  "response_format": (None, {"type": "text"})}


def _asks_nothing(value: Any, allowed: tuple) -> bool:
    """Whether ``value`` is one of ``allowed`` in type as well as value (``0`` is not ``False``)."""
    return any(value is a if a is None else (type(value) is type(a) and value == a) for a in allowed)


def parse_completion(body: Any, name: str, tiers: list[str], default_tier: str, tokenizer, vocab: int,
                     max_prompt: int, max_tokens_limit: int, aliases: dict[str, str] | None = None
                     ) -> CompletionParams:
    """Validate a completions body (see the module docstring); ``ApiError`` on the first problem."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    tier = resolve_model_field(body, name, tiers, default_tier, aliases)
    for key, allowed in _UNSUPPORTED.items():
        if not _asks_nothing(body.get(key), allowed):
            raise ApiError(400, f"{key} is not supported by this server; leave it out", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ApiError(400, f"{key} is not supported by this server; leave it out or set it to 0", key)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):      # 1.0 and true are not the integer 1
        raise ApiError(400, f"n must be 1 (one completion per request), got {n!r}", "n")
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", "prompt")
    prompt = parse_prompt(body["prompt"], tokenizer, vocab, max_prompt)
    max_tokens = _integer(body, "max_tokens", min(16, max_tokens_limit), 0, max_tokens_limit)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", 0, -1, vocab)
    seed = _integer(body, "seed", None, -(2 ** 63), 2 ** 63 - 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in stop):
        raise ApiError(400, "stop must be a string or a list of at most 4 non-empty strings of <= 64 characters",
                       "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if opts and not stream:                      # as vLLM: an empty object is let through
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    usage = (opts or {}).get("include_usage", False)
    if not isinstance(usage, bool | None):
        raise ApiError(400, f"stream_options.include_usage must be true or false, got {usage!r}", "stream_options")
    return CompletionParams(tier=tier, prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=max(top_k, 0), stop=stop, seed=seed, stream=stream, include_usage=bool(usage))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req, model_id: str, text: str) -> dict:
    """The non-streamed response of a finished request."""
    return {"id": req.id, "object": "text_completion", "created": int(req.created), "model": model_id,
            "tier": req.tier, "choices": [{"index": 0, "text": text, "logprobs": None,
                                           "finish_reason": req.finish_reason}],
            "usage": _usage(len(req.prompt), req.completion_tokens)}


def chunk_body(req, model_id: str, text: str, finish_reason: str | None, usage: bool = False) -> dict:
    """One streamed chunk (``usage``: the last, empty-choices chunk carrying the counts)."""
    body = {"id": req.id, "object": "text_completion", "created": int(req.created or time.time()),
            "model": model_id, "tier": req.tier}
    if usage:
        body["choices"], body["usage"] = [], _usage(len(req.prompt), req.completion_tokens)
    else:
        body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    return body


def special_token_ids(path: Path, specials: dict[str, str], tokenizer: Any = None) -> dict[str, int]:
    """Special-token text -> id, as the saved tokenizer knows them: the ``added_tokens`` marked ``special`` in
    ``tokenizer.json``, and the ``tokenizer_config.json`` tokens (``specials``: ``bos_token`` -> ``"<bos>"``) of
    the roles our tokenizer has ids for (``bos_id``, ``eos_id``, ``pad_id``, ``sep_id``)."""
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
    """A chat message's ``content`` as text: a string, or OpenAI's list of content parts whose ``text`` parts are
    joined (``[{"type": "text", "text": "..."}]``); any other part (an image, audio) is a 400 naming it, since
    the model reads text only."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        kinds = [part.get("type") for part in content]
        other = next((k for k in kinds if k != "text"), None)
        if other is not None:
            raise ApiError(400, f"messages[{index}].content has a {other!r} part; this model reads text only "
                           "(content parts of type 'text')", "messages")
        if all(isinstance(part.get("text"), str) for part in content):
            return "".join(part["text"] for part in content)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of {{type: 'text', text}} parts",
                   "messages")


class ChatTemplate:
    """A compiled chat template and the OpenAI chat response shapes.

    ``specials``: the template's special-token variables (``bos_token`` -> ``"<bos>"``); ``tokenizer`` and
    ``special_ids`` (special-token text -> id, from the saved ``tokenizer.json``): with them the rendered prompt
    is encoded as ``apply_chat_template`` encodes it (each special-token string one id, the text between them
    through the tokenizer); without them the rendered text is the prompt."""

    def __init__(self, source: str, specials: dict[str, str], tokenizer: Any = None,
                 special_ids: dict[str, int] | None = None) -> None:
        import jinja2.ext
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: Any) -> None:     # as transformers defines it for chat templates
            raise TemplateError(message)

        def strftime_now(fmt: str) -> str:
            return time.strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
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
    def from_model(cls, model, tokenizer: Any = None) -> ChatTemplate | None:
        path = getattr(model, "name_or_path", None)
        cfg = Path(path) / "tokenizer_config.json" if path else None
        if cfg is None or not cfg.is_file():
            return None
        try:
            meta = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        source = meta.get("chat_template")
        if not isinstance(source, str) or not source.strip():
            return None
        specials = {}
        for k, v in meta.items():             # "<bos>", or an AddedToken record {"content": "<bos>", ...}
            v = v.get("content") if isinstance(v, dict) else v
            if k.endswith("_token") and isinstance(v, str):
                specials[k] = v
        return cls(source, specials, tokenizer, special_token_ids(Path(path), specials, tokenizer))

    def encode(self, prompt: str) -> list[int] | str:
        """The rendered prompt's token ids (special-token strings as their ids), or the text without a tokenizer."""
        if self.tokenizer is None:
            return prompt
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(prompt) if self._split is not None else [prompt]):
            if i % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids += list(self.tokenizer.encode(piece))
        return ids if ids else prompt          # an empty prompt: parse_prompt's own message

    def as_completion(self, body) -> dict:
        """The completions body equivalent to a chat body (messages rendered and encoded into ``prompt``)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        messages = [{**m, "content": text_content(m.get("content"), i)} for i, m in enumerate(messages)]
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
        out = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens")}
        if body.get("max_completion_tokens") is not None:
            out["max_tokens"] = body["max_completion_tokens"]
        out["prompt"] = self.encode(prompt)
        return out

    @staticmethod
    def completion_body(req, model_id: str, text: str) -> dict:
        return {"id": req.id.replace("cmpl", "chatcmpl"), "object": "chat.completion", "created": int(req.created),
                "model": model_id, "tier": req.tier,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": req.finish_reason}],
                "usage": _usage(len(req.prompt), req.completion_tokens)}

    @staticmethod
    def chunk_body(req, model_id: str, text: str, finish_reason: str | None, usage: bool = False) -> dict:
        body = {"id": req.id.replace("cmpl", "chatcmpl"), "object": "chat.completion.chunk",
                "created": int(req.created), "model": model_id, "tier": req.tier}
        if usage:
            body["choices"], body["usage"] = [], _usage(len(req.prompt), req.completion_tokens)
        else:
            delta = {"content": text} if text else {}
            if text and not req.role_sent:                   # the first text chunk names the role
                delta["role"], req.role_sent = "assistant", True
            body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        return body
