"""CPU proxy of the serve benchmark: the real server process and load generator, the GPU replaced by a fixed cost.

``python -m elastic_ssm.bench.serve_proxy --step-ms 3.7 --streams 128`` (also the ``proxy`` entry of
the ``serve`` suite) runs ``elastic_ssm.bench.serve.bench_serve``
against a server whose pools are ``StubPool`` (a decode step of ``--step-ms`` wall time that releases the GIL
as a CUDA wait does; prefills of ``--prefill-ms`` + ``--prefill-us-per-token`` per token), so the numbers are
what the HTTP and engine layers of the server can push for that many streams on this machine. Beside the
bench's row it prints ``steps_s`` (decode steps per second the engine ran: 1000 / step-ms is the ceiling) and
``server_cpu`` (CPU cores the server process used). The load generator runs on the same machine: on a
small machine read ``steps_s`` and ``server_cpu`` as much as ``tok_s``.
"""

from __future__ import annotations

import argparse
import json

from .serve import bench_serve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=3.7, help="wall time of one decode step of the stub pool")
    p.add_argument("--prefill-ms", type=float, default=0.0, help="fixed wall time of one prefill forward")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0, help="prefill wall time per prompt token")
    p.add_argument("--streams", type=int, default=128, help="concurrent client streams")
    p.add_argument("--slots", type=int, default=128, help="slots of the served tier")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream, one after another")
    p.add_argument("--procs", type=int, default=2, help="load-generator processes")
    p.add_argument("--server-arg", action="append", default=[], help="another flag of the server process")
    a = p.parse_args()
    stub = ["--stub-step-ms", str(a.step_ms), "--stub-prefill-ms", str(a.prefill_ms),
            "--stub-prefill-us-per-token", str(a.prefill_us_per_token), *a.server_arg]
    row = bench_serve("tiny", ["T10"], ["T10"], a.streams, a.slots, a.prompt, a.new_tokens, a.rounds, a.procs,
                      "cpu", "float32", server_args=tuple(stub))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
