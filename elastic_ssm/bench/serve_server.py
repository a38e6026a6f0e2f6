"""The server process of the ``serve`` benchmark: the app of ``serve/app.py`` over a random-weight ESSH with
``IdTokenizer``, no weights on disk; with ``stub_step_ms`` its pools are ``StubPool``s (the CPU proxy). Started as
``python -m elastic_ssm.bench.serve_server`` with the flags of a ``BenchServerOptions`` (``cli_derive``)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Literal

from ..config import opt
from ..serve.engine import PREFILL_WAIT_MS
from ..serve.slots import GRAPH_TOKENS
from .serve_stub import IdTokenizer, StubPool

__all__ = ["BenchServerOptions", "main"]


@dataclass(kw_only=True)
class BenchServerOptions:
    """The bench server: its model, tiers and pools, and the serve settings the suite varies."""

    preset: str = opt("tiny", "ESSH preset of the random-weight model")
    tiers: str = opt("T10", "comma-separated tiers to serve (the last is the default tier)")
    slots: int = opt(16, "slots of the one pool every tier shares")
    port: int = opt(8000, "TCP port on 127.0.0.1")
    device: str = opt("cuda", "where the model runs")
    dtype: str = opt("bfloat16", "weights' dtype")
    seed: int = opt(0, "seed of the random weights")
    max_prefill: int = opt(16, "most prompts prefilled together in one forward")
    prefill_wait_ms: float = opt(PREFILL_WAIT_MS, "longest a waiting request is held for more arrivals to share "
                                                  "its prefill forward")
    prefill_graphs: bool = opt(True, "replay prefill forwards from CUDA graphs (serve --prefill_graphs)")
    prefill_graph_tokens: int = opt(GRAPH_TOKENS, "the largest graphed prefill, padded prompt tokens (serve "
                                                  "--prefill_graph_tokens)")
    attended_spans: bool = opt(True, "decode steps read the filled prefix of the window rings only (serve "
                                     "--attended_spans)")
    engine: Literal["process", "thread"] = opt("process", "the engine in its own process (as elastic-ssm serve) "
                                                          "or a thread of the HTTP process")
    stub_step_ms: float | None = opt(None, "CPU proxy: StubPool with a decode step of this many ms instead of the "
                                           "model's pools")
    stub_prefill_ms: float = opt(0.0, "CPU proxy: fixed ms per prefill forward")
    stub_prefill_us_per_token: float = opt(0.0, "CPU proxy: us per prefilled token")
    switch_interval: float | None = opt(None, "sys.setswitchinterval (experiments)")
    loop: str = opt("auto", "uvicorn's event loop (experiments)")
    http: str = opt("auto", "uvicorn's HTTP protocol (experiments)")


def _bench_model(preset: str, device: str, dtype: str, seed: int, stub: bool):
    """The bench server's model: random weights at ``preset`` with ``IdTokenizer`` (for the CPU proxy on CPU in
    float32 with a 1024-id vocabulary: above 260 ids, so the text is IdTokenizer's, one character per token).
    ``device="meta"``: the HTTP process's view of it."""
    import torch

    from ..config import ESSHConfig
    from .peers import build_essh

    torch.manual_seed(seed)
    cfg = ESSHConfig.preset(preset, vocab_size=1024) if stub else ESSHConfig.preset(preset)
    if stub and device != "meta":
        torch.set_num_threads(1)
        device, dtype = "cpu", "float32"
    model = build_essh(cfg, torch.device(device), getattr(torch, dtype))
    model.tokenizer = IdTokenizer(model.config.vocab_size)
    return model


def main(argv: list[str] | None = None) -> None:
    """The server process of the benchmark (random weights, ``IdTokenizer``)."""
    import uvicorn

    from ..cli_derive import derive
    from ..serve.app import ServerSettings, create_app

    a = derive(BenchServerOptions, argv, "python -m elastic_ssm.bench.serve_server", __doc__.splitlines()[0])

    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    stub = a.stub_step_ms is not None
    pool_factory = None
    if stub:
        pool_factory = functools.partial(StubPool, step_ms=a.stub_step_ms, prefill_ms=a.stub_prefill_ms,
                                         prefill_us_per_token=a.stub_prefill_us_per_token)
    load = functools.partial(_bench_model, a.preset, a.device, a.dtype, a.seed, stub)
    tiers = a.tiers.split(",")
    settings = ServerSettings(name="bench", tiers=tiers, default_tier=tiers[-1], slots=a.slots,
                              max_prefill=a.max_prefill, prefill_wait_ms=a.prefill_wait_ms,
                              prefill_graphs=a.prefill_graphs, prefill_graph_tokens=a.prefill_graph_tokens,
                              attended_spans=a.attended_spans,
                              max_queue=4 * a.slots,
                              max_connections_per_client=1 << 16, max_prompt_tokens=1 << 16, max_tokens_limit=1 << 16)
    if a.engine == "process":
        app = create_app(_bench_model(a.preset, "meta", a.dtype, a.seed, stub), settings, pool_factory, load=load)
    else:
        app = create_app(load(), settings, pool_factory)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", limit_concurrency=1 << 16, loop=a.loop,
                http=a.http)


if __name__ == "__main__":
    main()
