"""The serve proxy's server: the bench server (``elastic_ssm.bench.serve``) whose pools are ``StubPool``s of
fixed wall-time cost, on the CPU, with the settings of experiments on the server process (``ExperimentServerOptions``:
the engine as a thread, the switch interval, uvicorn's loop and HTTP parser). Started by ``bench_serve(...,
server_class=StubServerOptions)`` as ``python -m benchmarks.serve_stub`` with the flags of a ``StubServerOptions``."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Literal

from elastic_ssm.bench.serve import BenchServerOptions, run_server
from elastic_ssm.config import opt
from elastic_ssm.serve.slots import SlotRows, served_tiers

__all__ = ["StubPool", "ExperimentServerOptions", "StubServerOptions", "main"]


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
        tiers = list(tier) if isinstance(tier, (list, tuple)) else [tier] * len(prompts)   # SlotPool's: one per prompt
        for i, owner, t in zip(rows, owners, tiers):
            self.owner[i] = owner
            self.row_tier[i] = self.tier if t is None else self._resolve(t)
        return rows

    def admit(self, owner, prompt: list[int], tier=None) -> int:
        return self.admit_many([owner], [prompt], tier)[0]

    def step_async(self, tokens) -> list[int]:
        values = tokens.tolist()
        self._wait()
        self._occupy(self.step_s)
        self._next(list(range(self.slots)), values)
        return values


def _one_thread_pool(*args, **kw) -> StubPool:
    """A ``StubPool`` in a process of one torch thread (the engine's: the CPU is the load generator's too)."""
    import torch

    torch.set_num_threads(1)
    return StubPool(*args, **kw)


@dataclass(kw_only=True)
class ExperimentServerOptions(BenchServerOptions):
    """The bench server and the settings of experiments on its process (the serve proxy's ``--server.*``)."""

    engine: Literal["process", "thread"] = opt("process", "the engine in its own process (as elastic-ssm serve) "
                                                          "or a thread of the HTTP process")
    switch_interval: float | None = opt(None, "sys.setswitchinterval of the HTTP process")
    loop: str = opt("auto", "uvicorn's event loop")
    http: str = opt("auto", "uvicorn's HTTP protocol")

    @property
    def stack(self) -> str:
        """The event loop and HTTP parser the server runs (the serve rows' ``http_stack``): ``loop`` / ``http`` as
        given, uvicorn's ``auto`` pick (``serve.cli.http_stack``) where they are ``auto``."""
        from elastic_ssm.serve.cli import http_stack

        loop, http = http_stack().removeprefix("event loop ").split(", HTTP ")
        loop = self.loop if self.loop != "auto" else loop
        return f"event loop {loop}, HTTP {self.http if self.http != 'auto' else http}"


@dataclass(kw_only=True)
class StubServerOptions(ExperimentServerOptions):
    """The bench server with ``StubPool``s: their costs."""

    stub_step_ms: float = opt(3.7, "wall time of one decode step of the stub pool")
    stub_prefill_ms: float = opt(0.0, "fixed ms per prefill forward")
    stub_prefill_us_per_token: float = opt(0.0, "us per prefilled token")


def main(argv: list[str] | None = None) -> None:
    from elastic_ssm.cli_util import derive

    a = derive(StubServerOptions, argv, "python -m benchmarks.serve_stub", __doc__.splitlines()[0])
    a.device, a.dtype = "cpu", "float32"
    pools = functools.partial(_one_thread_pool, step_ms=a.stub_step_ms, prefill_ms=a.stub_prefill_ms,
                              prefill_us_per_token=a.stub_prefill_us_per_token)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    run_server(a, pools, vocab_size=1024,     # above 260 ids: the text is IdTokenizer's, one character per token
               thread_engine=a.engine == "thread", loop=a.loop, http=a.http)


if __name__ == "__main__":
    main()
