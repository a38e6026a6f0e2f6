"""The ``serve`` benchmark's server process: ``serve/app.py`` over a random-weight ESSH with ``IdTokenizer``.
Started as ``python -m elastic_ssm.bench.serve_server`` with the flags of a ``BenchServerOptions``
(``cli_util.derive``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import opt
from ..serve.engine import PREFILL_WAIT_MS
from ..serve.slots import GRAPH_TOKENS

__all__ = ["BenchServerOptions", "IdTokenizer", "run_server", "main"]


class IdTokenizer:
    """A stand-in tokenizer for random-weight models: token i <-> the character U+0100 + i (no specials)."""

    pad_id = bos_id = eos_id = sep_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text if 0 <= ord(c) - 0x100 < self.vocab_size]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + int(i)) for i in ids)


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


def _bench_model(preset: str, device: str, dtype: str, seed: int, vocab_size: int | None):
    """Random weights at ``preset`` (``vocab_size``: in place of the preset's) with ``IdTokenizer``;
    ``device="meta"``: the HTTP process's view of it."""
    import torch

    from ..config import ESSHConfig
    from .decode import random_model

    torch.manual_seed(seed)
    cfg = ESSHConfig.preset(preset, **({} if vocab_size is None else {"vocab_size": vocab_size}))
    model = random_model(cfg, torch.device(device), getattr(torch, dtype))
    model.tokenizer = IdTokenizer(model.config.vocab_size)
    return model


def run_server(a: BenchServerOptions, pool_factory=None, vocab_size: int | None = None, thread_engine: bool = False,
               **uvicorn_options) -> None:
    """Serve ``a``'s random-weight model on 127.0.0.1 until stopped, the engine in its own process as in ``elastic-ssm
    serve`` (``thread_engine``: a thread of the HTTP process; ``pool_factory``: ``Engine``'s; ``uvicorn_options``:
    more keywords of ``uvicorn.run``, e.g. ``loop``; the experiments of ``benchmarks/serve_stub.py``)."""
    import uvicorn

    from ..serve.app import ServerSettings, create_app

    load = functools.partial(_bench_model, a.preset, a.device, a.dtype, a.seed, vocab_size)
    tiers = a.tiers.split(",")
    same = ("max_prefill", "prefill_wait_ms", "prefill_graphs", "prefill_graph_tokens", "attended_spans")
    settings = ServerSettings(name="bench", tiers=tiers, default_tier=tiers[-1], slots=a.slots, max_queue=4 * a.slots,
                              max_connections_per_client=1 << 16, max_prompt_tokens=1 << 16, max_tokens_limit=1 << 16,
                              **{k: getattr(a, k) for k in same})
    if thread_engine:
        app = create_app(load(), settings, pool_factory)
    else:
        meta = _bench_model(a.preset, "meta", a.dtype, a.seed, vocab_size)
        app = create_app(meta, settings, pool_factory, load=load)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", limit_concurrency=1 << 16, **uvicorn_options)


def main(argv: list[str] | None = None) -> None:
    from ..cli_util import derive

    run_server(derive(BenchServerOptions, argv, "python -m elastic_ssm.bench.serve_server", __doc__.splitlines()[0]))


if __name__ == "__main__":
    main()
