"""Tokens in and out of a slot pool: per-row sampling on the device, and tokens to text with stop strings."""

from __future__ import annotations

import codecs

import torch

__all__ = ["sample_rows", "RowNoise", "TextStream"]


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
