"""The OpenAI API's bodies and rules (docs/serving.md, "The API"): pydantic request and response models, one
renderer of their validation errors, the rules a schema cannot say (tier names, prompt limits); every refusal is an
``ApiError``, answered in OpenAI's error shape (``error_body``)."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["CompletionRequest", "ChatCompletionRequest", "request_models", "error_message", "CompletionResponse",
           "ChatCompletionResponse", "ModelList", "ErrorResponse", "ApiError", "error_body", "resolve_model_field",
           "parse_prompt", "response_body", "shown"]


class ApiError(Exception):
    """A refused request: HTTP ``status`` and a one-line ``message`` (``param``: the field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "server_overloaded"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_STRICT = ConfigDict(strict=True, extra="ignore")
_STOP = Annotated[str, Field(min_length=1, max_length=64)]


def refused(*asks_nothing: Any) -> Any:
    """A field this server cannot honour: ``null`` or one of ``asks_nothing`` (equal in type and value) passes."""
    def check(value: Any) -> Any:
        if value is not None and not any(type(value) is type(a) and value == a for a in asks_nothing):
            raise PydanticCustomError("rule", "is not supported by this server; leave it out")
        return value
    shown = " or ".join(repr(a).replace("False", "false") for a in asks_nothing)
    return Annotated[Any, AfterValidator(check), Field(None, description=f"not supported: leave it out (or {shown})")]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = Field(None, description="a last chunk with empty choices and the usage counts")


class Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = _STRICT
    model: str | None = Field(None, description="NAME (the default tier), NAME@T4 (a tier), NAME@auto")
    tier: str | None = Field(None, description="extension: a served tier or 'auto'; must agree with model")
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="extension: 0 or -1 = off")
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1, description="a seeded request's text does not "
                             "depend on the requests sharing its batch")
    stop: _STOP | Annotated[list[_STOP], Field(max_length=4)] = Field(
        [], description="a string or a list of at most 4 non-empty strings of at most 64 characters")
    stream: bool = Field(False, description="server-sent events, ending with data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    user: str | None = Field(None, description="ignored")
    logprobs: refused(False)
    top_logprobs: refused(0)
    echo: refused(False)
    best_of: refused(1)
    suffix: refused("")
    logit_bias: refused({})
    tools: refused([])
    functions: refused([])
    tool_choice: refused("none", "auto")          # "required" or a named tool: a tool call this server cannot make
    function_call: refused("none", "auto")
    modalities: refused(["text"])                 # ["audio"]: spoken output
    response_format: refused({"type": "text"})
    presence_penalty: refused(0, 0.0)
    frequency_penalty: refused(0, 0.0)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k in fields and fields[k].is_required()} \
            if isinstance(data, dict) else data

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        if options is not None and options.model_fields_set and not info.data.get("stream"):   # {}: as vLLM
            raise PydanticCustomError("rule", "is only allowed with stream: true")
        return options

    def engine_fields(self) -> dict:
        """The engine ``Request``'s sampling fields (``max_completion_tokens``: chat's name for ``max_tokens``)."""
        limit = getattr(self, "max_completion_tokens", None)
        return {"max_tokens": self.max_tokens if limit is None else limit, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": max(self.top_k, 0), "seed": self.seed,
                "stop": [self.stop] if isinstance(self.stop, str) else self.stop}


_IDS = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | _IDS | Annotated[list[str] | list[_IDS], Field(min_length=1, max_length=1)] = Field(
        description="a string or a list of token ids, or a list of one of those (batched prompts: send one request "
                    "each)")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str = Field(description="'text'; this model reads text only")
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")     # a template may read more keys (name, tool_calls)
    role: str
    content: str | Annotated[list[ContentPart], Field(min_length=1)] = Field(
        description="a string or a list of {type: 'text', text} parts")

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart]) -> str:
        """The content as text: its parts joined (another part than text: this model reads text only)."""
        if isinstance(content, str):
            return content
        other = next((part.type for part in content if part.type != "text"), None)
        if other is not None:
            raise PydanticCustomError("rule", "has a {part} part; this model reads text only (content parts of type "
                                      "'text')", {"part": repr(other)})
        if any(part.text is None for part in content):
            raise PydanticCustomError("rule", "has a text part without its text")
        return "".join(part.text for part in content)


class ChatCompletionRequest(Sampling):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


def request_models(max_tokens: int, vocab: int) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The request models of a server taking at most ``max_tokens`` new tokens and a vocabulary of ``vocab``."""
    tokens = (int, Field(min(16, max_tokens), ge=0, le=max_tokens, description="new tokens at most"))
    reply = (int, Field(max_tokens, ge=0, le=max_tokens, description="new tokens at most (default: the server's "
                        "limit; a chat runs to its end, as in OpenAI's API)"))
    top_k = (int, Field(0, ge=-1, le=vocab, description="extension: 0 or -1 = off"))
    return (create_model("CompletionRequest", __base__=CompletionRequest, max_tokens=tokens, top_k=top_k),
            create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, max_tokens=reply, top_k=top_k,
                         max_completion_tokens=(int | None, Field(None, ge=0, le=max_tokens))))


def _forms(prop: dict, defs: dict) -> list[dict]:
    """The forms a JSON-schema property allows besides null, references resolved."""
    forms = [defs.get(f.get("$ref", "").rpartition("/")[2], f) for f in prop.get("anyOf", [prop])]
    return [f for f in forms if f.get("type") != "null"]


def _expected(prop: dict, defs: dict) -> str:
    """What a property asks for, in words (its description when it allows several forms)."""
    forms = _forms(prop, defs)
    if len(forms) != 1:
        return prop.get("description", "one of the documented forms")
    form, kind = forms[0], forms[0].get("type")
    if kind == "array":
        return f"a list of at most {form['maxItems']} items" if "maxItems" in form else \
            "a non-empty list" if form.get("minItems") else "a list"
    if kind not in ("integer", "number"):
        return {"boolean": "true or false", "string": "a string"}.get(kind, "an object")
    lo, hi = form.get("minimum", form.get("exclusiveMinimum")), form.get("maximum")
    show = (lambda v: str(v)) if kind == "integer" else (lambda v: f"{v:g}")
    if lo is not None and lo == hi:
        return show(lo)
    span = f" in {'(' if 'exclusiveMinimum' in form else '['}{show(lo)}, {show(hi)}]" if None not in (lo, hi) else ""
    return ("an integer" if kind == "integer" else "a number") + span


@functools.cache
def _schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema()


def error_message(error: dict, model: type[BaseModel]) -> tuple[str, str | None]:
    """(one-line message, top-level field) for a pydantic error (FastAPI's, its ``loc`` from "body") of ``model``."""
    loc = error["loc"][1:]
    if not loc:
        return "the request body must be a JSON object" + (
            " (send it with Content-Type: application/json)" if isinstance(error.get("input"), bytes) else ""), None
    schema = _schema(model)
    defs, prop, path = schema.get("$defs", {}), schema["properties"].get(loc[0], {}), str(loc[0])
    for step in loc[1:]:               # down to the property the error is about, or to a field of several forms
        forms = _forms(prop, defs)
        if len(forms) != 1:
            break
        prop = forms[0].get("items", {}) if isinstance(step, int) else forms[0].get("properties", {}).get(step, {})
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    if error["type"] == "missing":
        return f"{path} is required", str(loc[0])
    if error["type"] == "rule":        # ours: refused(), _needs_stream, ChatMessage._text_only
        return f"{path} {error['msg']}", str(loc[0])
    if error["type"] == "string_unicode":     # JSON's "\ud800": a bounded string (stop) refuses it
        return f"{path} is not valid UTF-8 text (it holds an unpaired surrogate)", str(loc[0])
    return f"{path} must be {_expected(prop, defs)}, got {shown(error.get('input'))}", str(loc[0])


def shown(value: Any) -> str:
    """``repr(value)`` cut to 40 characters: what an error message quotes of a client's input."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Answer(BaseModel):
    id: str
    created: int
    model: str = Field(description="NAME@TIER: the tier that answered (also in tier)")
    tier: str
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = Field(description="length (max_tokens), stop (a stop string or eos)")


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[Literal["role", "content"], str] = Field(description="{role: 'assistant', content}")
    finish_reason: str | None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str = Field(description="NAME (the default tier) or NAME@TIER")
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "elastic-ssm"
    tier: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str = Field(description="one line")
    type: str
    param: str | None = Field(None, description="the request field at fault")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every refusal of this server."""

    error: ErrorInfo


def resolve_model_field(model: str | None, extra: str | None, name: str, tiers: list[str], default_tier: str,
                        aliases: dict[str, str] | None = None) -> str:
    """The tier a request names by ``model`` and/or ``tier`` (``auto``: the default tier, since in one pool a
    smaller tier frees no capacity); ``aliases``: other names -> served tiers."""
    picked, field = None, "model"
    if model is not None:
        base, at, tier = model.partition("@")
        if at and not tier.strip():
            raise ApiError(400, f"model {shown(model)} names no tier after '@'; give '{name}' for the default tier or "
                                f"one of {', '.join(f'{name}@{t}' for t in tiers)}", "model")
        if base != name:
            raise ApiError(404, f"unknown model {shown(model)}; this server serves {name!r} "
                                f"(tiers: {', '.join(f'{name}@{t}' for t in tiers)})", "model")
        picked = tier or None
    if extra is not None:
        if picked is not None and picked.upper() != extra.upper():
            raise ApiError(400, f"model {shown(model)} and tier {shown(extra)} disagree; give one of them", "tier")
        picked, field = extra, "tier"
    if picked is None or picked.lower() == "auto":
        return default_tier
    for t in [*tiers, *(aliases or {})]:
        if t.upper() == picked.upper():
            return (aliases or {}).get(t, t)
    named = "" if field == "tier" else f"model {shown(model)}: "       # param: the field the client named it in
    raise ApiError(400, f"{named}tier {shown(picked)} is not served here; served tiers: {', '.join(tiers)} "
                        "(or 'auto')", field)


def parse_prompt(prompt: str | list, tokenizer, vocab: int, max_prompt: int) -> list[int]:
    """A validated ``prompt`` (``CompletionRequest``) as token ids, within the vocabulary and the limit."""
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):      # a batch of one
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


def response_body(req, model_id: str, chat: bool, text: str = "", finish_reason: str | None = None, *,
                  stream: bool = False, usage: bool = False) -> dict:
    """The body of ``req``'s whole answer, or with ``stream`` one chunk of it (``usage``: the last chunk, with empty
    choices and the counts); ``chat``: chat completions' shapes (the first streamed chunk names the role)."""
    body = {"id": req.id.replace("cmpl", "chatcmpl") if chat else req.id,
            "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
            "created": int(req.created), "model": model_id, "tier": req.tier, "choices": []}
    if not usage:
        if not chat:
            choice = {"text": text, "logprobs": None}
        elif not stream:
            choice = {"message": {"role": "assistant", "content": text}}
        else:
            first, req.role_sent = not req.role_sent, True   # the first chunk names the role, with text or not
            choice = {"delta": {"role": "assistant", "content": text} if first else {"content": text} if text else {}}
        body["choices"] = [{"index": 0, **choice, "finish_reason": finish_reason}]
    if usage or not stream:
        n, m = len(req.prompt), req.completion_tokens
        body["usage"] = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
    return body
