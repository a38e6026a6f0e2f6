"""CPU proxy of the serve benchmark: the real server process and load generator, the GPU replaced by a fixed cost.

``python -m elastic_ssm.bench.serve_proxy --step_ms 3.7 --streams 128`` (also the ``proxy`` entry of
the ``serve`` suite) runs ``elastic_ssm.bench.serve.bench_serve``
against a server whose pools are ``StubPool`` (a decode step of ``--step_ms`` wall time that releases the GIL
as a CUDA wait does; prefills of ``--prefill_ms`` + ``--prefill_us_per_token`` per token), so the numbers are
what the HTTP and engine layers of the server can push for that many streams on this machine. Beside the
bench's row it prints ``steps_s`` (decode steps per second the engine ran: 1000 / step_ms is the ceiling) and
``server_cpu`` (CPU cores the server process used). The load generator runs on the same machine: on a
small machine read ``steps_s`` and ``server_cpu`` as much as ``tok_s``. Flags: the fields of ``ProxyOptions``
(tyro, ``cli.derive``); ``--server KEY=VALUE`` sets another option of the server process (``BenchServerOptions``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import yaml

from ..config import ConfigError, opt
from .serve import bench_serve


@dataclass(kw_only=True)
class ProxyOptions:
    """The stub's costs and the load."""

    step_ms: float = opt(3.7, "wall time of one decode step of the stub pool")
    prefill_ms: float = opt(0.0, "fixed wall time of one prefill forward")
    prefill_us_per_token: float = opt(0.0, "prefill wall time per prompt token")
    streams: int = opt(128, "concurrent client streams")
    slots: int = opt(128, "slots of the served tier")
    prompt: int = opt(128, "prompt tokens per request")
    new_tokens: int = opt(256, "tokens generated per request")
    rounds: int = opt(2, "requests per stream, one after another")
    procs: int = opt(2, "load-generator processes")
    server: tuple[str, ...] = opt((), "more options of the server process as KEY=VALUE (VALUE read as YAML), "
                                      "fields of bench.serve_server.BenchServerOptions, e.g. max_prefill=8")


def main(argv: list[str] | None = None) -> None:
    from ..cli import derive

    a = derive(ProxyOptions, argv, "python -m elastic_ssm.bench.serve_proxy", __doc__.splitlines()[0])
    server = {"stub_step_ms": a.step_ms, "stub_prefill_ms": a.prefill_ms,
              "stub_prefill_us_per_token": a.prefill_us_per_token}
    for item in a.server:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"python -m elastic_ssm.bench.serve_proxy: error: --server {item}: give KEY=VALUE")
        server[key.strip()] = yaml.safe_load(value)
    try:
        row = bench_serve("tiny", ["T10"], ["T10"], a.streams, a.slots, a.prompt, a.new_tokens, a.rounds, a.procs,
                          "cpu", "float32", server=server)
    except (TypeError, ConfigError) as e:
        raise SystemExit(f"python -m elastic_ssm.bench.serve_proxy: error: {e}") from None
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
