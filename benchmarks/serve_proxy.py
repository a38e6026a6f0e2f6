"""CPU proxy of the serve benchmark: the real server process and load generator, the GPU replaced by a fixed cost.

``python -m benchmarks.serve_proxy --step_ms 3.7 --streams 128`` (also the ``proxy`` entry of the ``serve`` suite)
runs ``elastic_ssm.bench.serve.bench_serve`` against the server of ``benchmarks/serve_stub.py``, whose pools are
``StubPool`` (a decode step of ``--step_ms`` wall time that releases the GIL as a CUDA wait does; prefills of
``--prefill_ms`` + ``--prefill_us_per_token`` per token), so the numbers are what the HTTP and engine layers of the
server can push for that many streams on this machine. Beside the bench's row it prints ``steps_s`` (decode steps
per second the engine ran: 1000 / step_ms is the ceiling) and ``server_cpu`` (CPU cores the server process used).
The load generator runs on the same machine: on a small machine read ``steps_s`` and ``server_cpu`` as much as
``tok_s``. Flags: the fields of ``ProxyOptions`` (tyro, ``cli_util.derive``); ``--server.<field>`` sets another option
of the server process (``ExperimentServerOptions``, e.g. ``--server.max_prefill 8`` or ``--server.engine thread``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from benchmarks.serve_stub import ExperimentServerOptions, StubServerOptions
from elastic_ssm.bench.serve import bench_serve
from elastic_ssm.config import opt

#: the server options the proxy sets itself: the tiny preset's T10 on the CPU, ``--slots``, a free port, seed 0
_SET_HERE = ("preset", "tiers", "slots", "port", "device", "dtype", "seed")


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
    server: ExperimentServerOptions = field(default_factory=ExperimentServerOptions, metadata={
        "help": "the server process's other options (its preset, tiers, slots, port, device, dtype and seed are "
                "the proxy's)"})


def main(argv: list[str] | None = None) -> None:
    from elastic_ssm.cli_util import derive

    a = derive(ProxyOptions, argv, "python -m benchmarks.serve_proxy", __doc__.splitlines()[0])
    server = {f.name: getattr(a.server, f.name) for f in dataclasses.fields(a.server) if f.name not in _SET_HERE}
    server.update(stub_step_ms=a.step_ms, stub_prefill_ms=a.prefill_ms,
                  stub_prefill_us_per_token=a.prefill_us_per_token)
    row = bench_serve("tiny", ["T10"], ["T10"], a.streams, a.slots, a.prompt, a.new_tokens, a.rounds, a.procs,
                      "cpu", "float32", server=server, server_class=StubServerOptions)
    row["http_stack"] = a.server.stack        # the server's, as --server.loop / --server.http set it
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
