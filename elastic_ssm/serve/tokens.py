"""Tokens in and out of a slot pool: per-row sampling on the device, and tokens to text with stop strings.

Chat templates (docs/serving.md, "Chat"): ``ChatTemplate`` renders and encodes messages by transformers'
``apply_chat_template``; ``chat_template_source`` reads ``--chat_template`` (a ``BUILTIN`` name or a file)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..utils.files import read_json
from .schema import ApiError

__all__ = ["sample_rows", "RowNoise", "TextStream", "BUILTIN", "chat_template_source", "ChatTemplate", "compiled",
           "default_template"]


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                noise: torch.Tensor | None, filters: bool = True) -> torch.Tensor:
    """logits [B, V]; temperature / top_p float [B], top_k long [B]; noise [B, V] of Exp(1) draws (None when
    every row is greedy); ``filters=False`` skips the top-k / top-p sort (every row has k=0, p=1).
    Returns token ids [B]."""
    greedy = logits.argmax(-1)                                                          # [B]
    if noise is None:
        return greedy
    x = logits.float() / temperature.clamp_min(1e-6)[:, None]                         # [B, V]
    if filters:
        V = x.shape[-1]
        srt, idx = x.sort(-1, descending=True)                                          # [B, V]
        k = torch.where(top_k > 0, top_k, V).clamp(1, V)
        kth = srt.gather(1, (k - 1)[:, None])                                          # [B, 1]
        srt = srt.masked_fill(srt < kth, float("-inf"))
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p > top_p[:, None]) & (top_p < 1)[:, None]
        srt = srt.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, srt)
    sampled = (x.softmax(-1) / noise).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


class RowNoise:
    """Exp(1) noise [B, V] for ``sample_rows``: seeded rows from their own generator, the rest shared."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.buf = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.shared = torch.Generator(device=device)
        self.shared.seed()
        self.own: dict[int, torch.Generator] = {}

    def seed_row(self, row: int, seed: int | None) -> None:
        """Give ``row`` its own generator seeded with ``seed`` (None: the shared one)."""
        if seed is None:
            self.own.pop(row, None)
        else:
            self.own[row] = torch.Generator(device=self.buf.device).manual_seed(seed)

    def draw(self) -> torch.Tensor:
        self.buf.exponential_(1.0, generator=self.shared)
        for row, g in self.own.items():
            self.buf[row:row + 1].exponential_(1.0, generator=g)
        return self.buf


class TextStream:
    """The text of one request's generated tokens: byte models through an incremental UTF-8 decoder (specials
    256+ dropped), subword models by a window of recent tokens. The earliest ``stop`` string ends it unsent; the
    last ``max(len(stop)) - 1`` characters are held back until they cannot begin one."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.bytes = tokenizer.vocab_size <= 260
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = self._read = 0          # subword window: decoded ids[prefix:read] already counted
        self.text = ""                          # all decoded text so far
        self.sent = 0                           # characters of ``text`` already handed out
        self.stopped = False

    def _decode_new(self, token: int) -> str:
        if self.bytes:
            return self._utf8.decode(bytes([token])) if 0 <= token < 256 else ""
        self._ids.append(token)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = max(0, len(self._ids) - 6), len(self._ids)
            return after[len(before):]
        return ""

    def _window(self) -> tuple[str, str]:
        """The subword window's text without and with the tokens not yet turned into text."""
        return self.tok.decode(self._ids[self._prefix:self._read]), self.tok.decode(self._ids[self._prefix:])

    def push(self, token: int) -> str:
        """Add one generated token; the text that can be sent now (stop strings cut and held back)."""
        return self._add(self._decode_new(token))

    def _add(self, new: str) -> str:
        start = len(self.text)
        self.text += new
        if self.stop:
            hold = max(len(s) for s in self.stop) - 1
            cut = min((i for i in (self.text.find(s, max(0, start - hold)) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
                return self.flush()
            return self._take(len(self.text) - hold)
        return self._take(len(self.text))

    def flush(self) -> str:
        """Everything decoded and not yet sent."""
        return self._take(len(self.text))

    def finish(self) -> str:
        """The rest of the text at the end of a request: a trailing incomplete character (a byte model's last bytes,
        a subword model's held-back tokens) becomes U+FFFD, as ``tokenizer.decode`` of all the tokens gives, unless a
        stop string ended it."""
        if self.stopped:
            return self.flush()
        if self.bytes:
            rest = self._utf8.decode(b"", final=True)
        else:
            before, after = self._window()
            rest = after[len(before):]
        return self._add(rest) + self.flush()

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out


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
    compiled(text, f"--chat_template {spec}")
    return text


def default_template(saved: Any) -> Any:
    """A saved ``chat_template``: a string, or transformers' list of named ones, of which ``default`` is used."""
    if isinstance(saved, list):
        return next((t.get("template") for t in saved if isinstance(t, dict) and t.get("name") == "default"), None)
    return saved


def compiled(source: str, what: str, fix: str = "") -> Any:
    """``source`` compiled in the Jinja sandbox transformers renders chat templates in; one that Jinja cannot compile
    is a one-line ``ConfigError`` naming ``what`` (the template's flag or file), then ``fix``."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ConfigError(f"{what} is not a valid Jinja template{where}: {e.message}{fix}") from None


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
        compiled(source, f"the chat template of {origin}", "; fix it, or replace it with --chat_template chatml (or "
                 "plain, or a Jinja file)")       # the directory's own (--chat_template's was compiled when read)
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
