"""The serve bench's stand-ins: ``IdTokenizer`` (one character per token id) and ``StubPool`` (a slot pool of
fixed wall-time cost, for the CPU proxy), built by the bench server (``serve_server.py``)."""

from __future__ import annotations

import time

from ..serve.slots import SlotRows, served_tiers

__all__ = ["IdTokenizer", "StubPool"]


class IdTokenizer:
    """A stand-in tokenizer for random-weight models: token i <-> the character U+0100 + i (no specials)."""

    pad_id = bos_id = eos_id = sep_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text if 0 <= ord(c) - 0x100 < self.vocab_size]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + int(i)) for i in ids)


class StubPool(SlotRows):
    """A ``SlotPool`` stand-in whose decode step and prefills cost fixed wall time: the CPU proxy of the GPU.

    ``step_async`` waits for the previous step (a sleep, releasing the GIL as a CUDA wait does), starts the next
    (ready ``step_ms`` later) and returns the tokens at once. A prefill of ``n`` prompts of ``T`` tokens occupies
    the "device" for ``prefill_ms + prefill_us_per_token * n * T / 1000`` ms. Greedy text is row ``r``'s last token
    + 1 (mod V). ``prefill_graphs``, ``spans`` and ``max_graph_tokens`` are accepted and ignored."""

    def __init__(self, model, tiers, slots: int, step_ms: float, prefill_ms: float = 0.0,
                 prefill_us_per_token: float = 0.0, max_prefill: int = 16, prefill_graphs: bool | None = None,
                 spans: bool = True, max_graph_tokens: int = 0) -> None:
        import torch

        super().__init__(slots)
        self.tiers, self.device = served_tiers(model, tiers), torch.device("cpu")
        self.tier, self._resolve = self.tiers[-1], model.resolve_tier
        self.row_tier = [self.tier] * slots
        self.V = model.config.vocab_size
        self.logits = torch.zeros(slots, self.V)                                      # [slots, V]
        self.max_prefill = min(slots, max_prefill)
        self.step_s, self.prefill = step_ms / 1e3, (prefill_ms / 1e3, prefill_us_per_token / 1e6)
        self.graphed, self._ready = False, 0.0

    def _occupy(self, seconds: float) -> None:
        """The device runs for ``seconds`` more after the work already queued (host does not wait)."""
        self._ready = max(time.monotonic(), self._ready) + seconds

    def _wait(self) -> None:
        left = self._ready - time.monotonic()
        if left > 0:
            time.sleep(left)

    def _next(self, rows: list[int], last: list[int]) -> None:
        self.logits[rows] = 0.0
        self.logits[rows, [(t + 1) % self.V for t in last]] = 1.0

    def admit_many(self, owners: list, prompts: list[list[int]], tier=None) -> list[int]:
        rows = self.free_rows(len(prompts))
        if len(rows) < len(prompts):
            raise ValueError("no free slot")
        self._occupy(self.prefill[0] + self.prefill[1] * len(prompts) * max(len(p) for p in prompts))  # padded
        self._next(rows, [p[-1] for p in prompts])
        for i, owner in zip(rows, owners):
            self.owner[i] = owner
            self.row_tier[i] = self.tier if tier is None else self._resolve(tier)
        return rows

    def admit(self, owner, prompt: list[int], tier=None) -> int:
        return self.admit_many([owner], [prompt], tier)[0]

    def step_async(self, tokens) -> list[int]:
        values = tokens.tolist()
        self._wait()
        self._occupy(self.step_s)
        self._next(list(range(self.slots)), values)
        return values
