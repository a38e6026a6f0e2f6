"""Cached autoregressive generation: one prefill, then one decode step per token (ESSH Algorithm 4), and the
input checks of every architecture's ``forward``, ``step`` and ``generate``.

Hugging Face's argument names; a left-padded batch (``attention_mask`` [B, T], 1 = token) gives every row its
unpadded result; the loop never syncs with the host per token."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from ..elastic.tiers import check_counts
from ..utils.progress import tuning_notice


def check_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """One-line ValueErrors for sampling values outside their range."""
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
                                    or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1] (1 = no nucleus filter), got {top_p!r}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] on the device, no host sync: argmax at ``temperature == 0``, else
    temperature, ``top_k``, ``top_p``, then the exponential race ``argmax_i p_i / E_i`` (E_i ~ Exp(1))."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, idx = logits.sort(-1, descending=True)
        p = sorted_logits.softmax(-1)
        drop = p.cumsum(-1) - p > top_p                         # keep the smallest set with mass >= top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def check_token_inputs(input_ids: Any, vocab_size: int, attention_mask: Any = None, left_padding: bool = False) -> None:
    """``input_ids`` an integer tensor [B, T] with B, T >= 1 and ids in [0, vocab_size); ``attention_mask`` (when
    given) a tensor of exactly that shape (never broadcast) holding 0 / 1 with a 1 in every row, its zeros before
    the ones with ``left_padding``. A ``ValueError`` (``TypeError`` for a non-tensor) names the problem, the same
    for every architecture. The value checks read the host and are skipped while tracing (``torch.compile``)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}; for a single sequence "
                         "pass input_ids[None]")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor of token ids (torch.long or torch.int32), got "
                         f"{input_ids.dtype}")
    if 0 in input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} is empty; pass at least one sequence of at least one "
                         "token")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must be [B, T] = {tuple(input_ids.shape)} like input_ids (1 = real token, "
                         f"0 = left padding), got {got}; it is never broadcast")
    if torch.compiler.is_compiling():
        return
    lo, hi, V = int(input_ids.min()), int(input_ids.max()), vocab_size
    if lo < 0 or hi >= V:
        raise ValueError(f"token id {hi if hi >= V else lo} is outside the vocabulary [0, {V}) (token ids must lie "
                         f"in [0, vocab_size)); check the tokenizer or build the model with vocab_size > "
                         f"{max(hi, V - 1)}")
    if attention_mask is None:
        return
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token), got other values")
    m = attention_mask.long()
    if left_padding and (m[:, 1:] < m[:, :-1]).any():
        raise ValueError("attention_mask must use LEFT padding (zeros before the real tokens of each row)")
    if (m.sum(1) == 0).any():
        raise ValueError("every row needs at least one real token (attention_mask row of zeros)")


def token_positions(valid: torch.Tensor | None, B: int, T: int, device: Any) -> torch.Tensor:
    """Positions [B, T] of the tokens: 0 .. T-1, or with ``valid`` [B, T] (left padding) the number of real
    tokens before each (0 on the padding)."""
    return torch.arange(T, device=device).expand(B, T) if valid is None else (valid.long().cumsum(1) - 1).clamp_min(0)


def check_step_tokens(tokens: Any, batch: int, vocab_size: int) -> None:
    """A model's ``step`` input: one integer token id per sequence, tokens [batch], in the vocabulary (read on
    the host; the fused decoder does not)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32) \
            or tuple(tokens.shape) != (batch,):
        got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"step takes one integer token id per sequence, tokens [B={batch}]; got {got}")
    check_token_inputs(tokens[None], vocab_size)


class ReferenceSession:
    """The reference decode path: a fresh cache, ``forward(..., cache=)`` prefill, the model's ``step``."""

    def __init__(self, model, batch: int, tier: Any, state_dtype, kv_dtype, **cache_kw: Any) -> None:
        self.model, self.tier = model, tier
        self.cache = model.allocate_cache(batch, tier, state_dtype=state_dtype, kv_dtype=kv_dtype, **cache_kw)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Prompt [B, T] -> logits of its last position [B, V]; fills the cache."""
        return self.model(input_ids, tier=self.tier, attention_mask=attention_mask, cache=self.cache)[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.step(tokens, self.cache)


class GenerationMixin:
    """``generate`` for models with ``allocate_cache``, a prefilling ``forward(..., cache=)`` and
    ``step(tokens, cache)``; a model with a fused decoder overrides ``_decode_session``."""

    #: keyword arguments of ``generate`` that go to ``allocate_cache`` (ES-SSM: decode, n_modes)
    cache_options: tuple[str, ...] = ()

    def _decode_session(self, batch: int, tier: Any, fast: bool | None, state_dtype, kv_dtype, **cache_kw: Any):
        """An object with ``prefill(ids, mask) -> logits [B, V]`` and ``step(tokens [B]) -> logits [B, V]``."""
        if fast:
            raise ValueError(f"{type(self).__name__} has no fused decoder; use fast=None or False")
        return ReferenceSession(self, batch, tier, state_dtype, kv_dtype, **cache_kw)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, tier: Any = None,
                 attention_mask: torch.Tensor | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 streamer: Callable[[torch.Tensor], None] | None = None,
                 generator: torch.Generator | None = None, fast: bool | None = None,
                 state_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                 sync_every: int = 16, eos: int | None = None, **unknown: Any) -> torch.Tensor:
        """Return ``input_ids`` followed by up to ``max_new_tokens`` generated tokens, [B, T + new].

        Greedy unless ``do_sample`` (None: sample exactly when a ``temperature`` > 0, ``top_k`` or ``top_p`` is
        given). A row stops at ``eos_token_id`` (an id or a list of ids; default: the config's; ``eos`` is an alias)
        and then emits ``pad_token_id`` (default: the first eos id); generation ends once every row has, checked
        every ``sync_every`` tokens. ``streamer(tokens [B])`` gets each step's device tensor (a transformers streamer,
        e.g. ``TextStreamer``: ``put`` of the prompt and of each step's tokens on the CPU, then ``end``). ``fast``:
        None / True = the fused decoder, False = the reference step. Caches: fp32 states, a bf16 KV ring on CUDA
        (CPU: parameter dtype). The model's ``cache_options`` (ES-SSM: ``decode``, ``n_modes``) go to its
        ``allocate_cache``."""
        cache_kw = {k: unknown.pop(k) for k in self.cache_options if k in unknown}
        if unknown:
            supported = [p for p in inspect.signature(self.generate).parameters if p != "unknown"]
            raise TypeError(f"generate() got unsupported argument(s) {sorted(unknown)}; supported: "
                            f"{', '.join(supported + list(self.cache_options))}")
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            input_ids = input_ids[None]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if eos is not None and eos_token_id is not None and eos != eos_token_id:
            raise ValueError(f"eos={eos} and eos_token_id={eos_token_id} disagree; give one of them")
        eos = eos_token_id if eos_token_id is not None else eos
        if eos is None and self.config.eos_token_id >= 0:
            eos = self.config.eos_token_id
        stops = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        pad = pad_token_id if pad_token_id is not None else stops[0] if stops else None
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and 0 in input_ids.shape:
            raise ValueError(f"the prompt is empty (input_ids of shape {tuple(input_ids.shape)}): give every row "
                             "at least one token (e.g. the bos token)")
        check_counts(0, max_new_tokens=max_new_tokens)
        V = self.config.vocab_size
        for name, t in [*(("eos_token_id", s) for s in stops or [eos]), ("pad_token_id", pad)]:
            if t is not None and (not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V):
                raise ValueError(f"{name} must be a token id in [0, vocab_size={V})"
                                 f"{' or a non-empty list of them' if name == 'eos_token_id' else ''}, got {t!r}")
        check_token_inputs(input_ids, V, attention_mask, left_padding=True)
        check_sampling(temperature, top_k, top_p)
        if do_sample is not None and not isinstance(do_sample, bool):
            raise TypeError(f"do_sample must be True, False or None (sample when a temperature > 0, top_k or top_p is "
                            f"given), got {do_sample!r}")
        if generator is not None and (not isinstance(generator, torch.Generator)
                                      or generator.device.type != input_ids.device.type):
            got = f"one on {generator.device}" if isinstance(generator, torch.Generator) else repr(generator)
            kind = input_ids.device.type
            raise TypeError(f"generator must be None or a torch.Generator on the model's device ({kind}), e.g. "
                            f"torch.Generator({kind!r}).manual_seed(0); got {got}")
        if do_sample is None:
            do_sample = (temperature is not None and temperature > 0) or bool(top_k) or top_p is not None
        temp = 0.0 if not do_sample else (1.0 if temperature is None else float(temperature))
        check_counts(sync_every=sync_every)
        hf_streamer = streamer if hasattr(streamer, "put") and hasattr(streamer, "end") else None   # transformers'
        if hf_streamer is not None:                      # TextStreamer & co.: the prompt, each step's tokens, end()
            hf_streamer.put(input_ids.cpu())
            streamer = lambda tokens: hf_streamer.put(tokens.cpu())   # noqa: E731
        elif streamer is not None and not callable(streamer):
            raise TypeError(f"streamer must be a function of each step's tokens [B] or a transformers streamer (put, "
                            f"end), got {type(streamer).__name__}")
        was_training = self.training
        self.eval()
        try:
            B = input_ids.shape[0]
            with tuning_notice(input_ids.device):        # a fresh machine's first decoder and prefill say so
                session = self._decode_session(B, tier, fast, state_dtype, kv_dtype, **cache_kw)
                logits = session.prefill(input_ids, attention_mask)
            new = self._decode_loop(logits, session.step, max_new_tokens, temp, top_k, top_p, stops, pad, streamer,
                                    generator, sync_every)
            if hf_streamer is not None:
                hf_streamer.end()
            return torch.cat([input_ids, new], dim=1)
        finally:
            self.train(was_training)

    @staticmethod
    def _decode_loop(logits, step, n_new: int, temperature, top_k, top_p, stops, pad, streamer, generator,
                     sync_every: int) -> torch.Tensor:
        """Sample ``n_new`` tokens [B, n] on the device; cut after the step at which every row emitted a stop id."""
        B, dev = logits.shape[0], logits.device
        # one stop id: one comparison a step, as before lists were taken; several: ``isin`` (two kernels)
        eos = None if not stops else stops[0] if len(stops) == 1 else torch.tensor(stops, device=dev)
        # the buffers grow as tokens come: max_new_tokens is a bound (10**9 with an eos is fine), not an allocation
        out = torch.empty(B, min(n_new, 1024), dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        all_done = torch.zeros(out.shape[1], dtype=torch.bool, device=dev)
        n = 0
        for i in range(n_new):
            if i == out.shape[1]:
                out = torch.cat([out, torch.empty_like(out)], dim=1)
                all_done = torch.cat([all_done, torch.zeros_like(all_done)])
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos is not None:
                nxt = torch.where(done, pad, nxt)
                done |= (nxt == eos) if isinstance(eos, int) else torch.isin(nxt, eos)
                all_done[i] = done.all()
            out[:, i] = nxt
            n = i + 1
            if streamer is not None:
                streamer(nxt)
            # a streamer reads every token anyway (a sync per step), so the stop is checked at once
            if eos is not None and (streamer is not None or n % sync_every == 0) and bool(all_done[i]):
                break
            if n < n_new:
                logits = step(nxt)
        if eos is not None and n:
            hit = all_done[:n].nonzero()
            n = int(hit[0, 0]) + 1 if hit.numel() else n
        return out[:, :n]
