"""The ``serve`` bench: concurrent streams against a real server process from load-generator processes over raw
HTTP/1.1 keep-alive; tokens/s, p50/p99 time to first token and inter-token latency, the engine's counters and the
server's CPU (docs/serving.md, "Benchmark").

The server process: ``serve/app.py`` over a random-weight ESSH with ``IdTokenizer``, started as ``python -m
elastic_ssm.bench.serve`` with the flags of a ``BenchServerOptions`` (``cli_util.derive``)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ..config import ESSHConfig, opt
from ..serve.engine import COUNTERS, PREFILL_WAIT_MS
from ..serve.slots import GRAPH_TOKENS

__all__ = ["serve_suite", "bench_serve", "wait_healthy", "free_port", "BenchServerOptions", "IdTokenizer",
           "run_server", "main"]


async def _stream_once(reader, writer, host: str, body: dict):
    """POST one streamed completion on an open keep-alive connection; yields (arrival time, characters of text)
    per read that carried text: raw HTTP/1.1 with chunked transfer, so the client costs little per token."""
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(raw), raw))
    status, headers = int((await reader.readline()).split()[1]), {}
    while (line := await reader.readline()) not in (b"\r\n", b""):        # the response's headers
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if status != 200:
        n = int(headers.get("content-length", "0"))
        raise RuntimeError(f"server answered {status}: {(await reader.readexactly(n))[:200]!r}")
    buf, sse, done = b"", b"", False
    while not done:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the stream")
        now = time.perf_counter()
        buf += data
        while (i := buf.find(b"\r\n")) >= 0:          # whole chunks of the chunked body
            size = int(buf[:i], 16)
            if len(buf) < i + 4 + size:
                break
            sse += buf[i + 2:i + 2 + size]
            buf = buf[i + 4 + size:]
            if size == 0:
                done = True
                break
        events, _, sse = sse.rpartition(b"\n\n")
        n = 0
        for line in events.split(b"\n"):
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                n += len(choices[0].get("text") or "")
        if n:
            yield now, n


def _client(args: tuple) -> dict:
    """One client process: its streams, run concurrently (one keep-alive connection each); raw timings.
    Inter-token latency is the gap between reads that carried text (what a client sees; several events
    read at once are one arrival)."""
    import asyncio
    import random

    base, streams, rounds, prompt, new_tokens, vocab, seed = args
    host, port = base.split("//", 1)[1].rsplit(":", 1)

    async def one(tier: str, rng) -> tuple[list, list, int]:
        ttft, itl, tokens = [], [], 0
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
        try:
            for _ in range(rounds):
                body = {"model": f"bench@{tier}", "prompt": [rng.randrange(vocab) for _ in range(prompt)],
                        "max_tokens": new_tokens, "temperature": 0, "stream": True}
                t0 = last = time.perf_counter()
                first = True
                async for now, n in _stream_once(reader, writer, host, body):
                    (ttft.append(now - t0) if first else itl.append(now - last))
                    first, last = False, now
                    tokens += n
        finally:
            writer.close()
        return ttft, itl, tokens

    async def main() -> dict:
        res = await asyncio.gather(*(one(t, random.Random(seed * 1000 + i)) for i, t in enumerate(streams)))
        return {"cpu": time.process_time() - cpu0, "ttft": [x for r in res for x in r[0]],
                "itl": [x for r in res for x in r[1]], "tokens": sum(r[2] for r in res)}

    cpu0 = time.process_time()
    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll ``base``/health until it answers 200 (True); False when ``proc`` exits or ``timeout`` s pass (the
    process is then killed)."""
    import httpx

    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    return False


def _server_stats(base: str, pid: int) -> tuple[dict[str, float], tuple[float, float]]:
    """({counter: value so far} of the server's ``/metrics``, CPU seconds of the HTTP process and of all the
    server's processes, ``_tree_cpu``) — the server's side of a measurement."""
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = {x.split()[0]: float(x.split()[-1]) for x in text.splitlines() if x.startswith("elastic_ssm_")}
    return {c: values.get(f"elastic_ssm_{c}_total", math.nan) for c in COUNTERS}, _tree_cpu(pid)


def _tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of (process ``pid`` alone — the HTTP process —, it and its descendants — the engine process —),
    from /proc (NaN elsewhere)."""
    own = float("nan")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own = total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(_tree_cpu(int(c))[1] for c in f.read().split())
    except (OSError, ValueError):
        total = float("nan")
    return own, total


def bench_serve(preset: str, tiers: list[str], mix: list[str], streams: int, slots: int, prompt: int,
                new_tokens: int, rounds: int, procs: int, device: str, dtype: str, seed: int = 0,
                server: dict | None = None, server_class: type | None = None) -> dict:
    """Start the server process, drive ``streams`` streams over the tiers of ``mix``, return the row
    (``server``: more options of the server process; ``server_class``: a ``BenchServerOptions`` subclass whose
    module is the server's, default ``BenchServerOptions``)."""
    from ..cli_util import to_argv
    from ..serve.cli import http_stack  # the server process: this interpreter, this environment

    vocab = ESSHConfig.preset(preset).vocab_size
    port = free_port()
    server_class = server_class or BenchServerOptions
    opts = server_class(preset=preset, tiers=",".join(tiers), slots=slots, port=port, device=device,
                        dtype=dtype, seed=seed, **(server or {}))
    cmd = [sys.executable, "-m", server_class.__module__, *to_argv(opts)]
    log = tempfile.TemporaryFile(mode="w+")       # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(base, proc, 900):
            log.seek(0)
            raise RuntimeError(f"the bench server did not start: {log.read()[-500:]}")
        plan = [mix[i % len(mix)] for i in range(streams)]
        procs = max(1, min(procs, streams))
        with mp.get_context("spawn").Pool(procs) as pool:
            # warm-up: the same streams twice with a few tokens, so that first-use costs (fla's autotuning of the
            # prefill shapes, the capture of a prefill graph at a shape's second use, CUDA context of the clients)
            # are reported apart from the served rate
            t0 = time.perf_counter()
            pool.map(_client, [(base, plan[i::procs], 2, prompt, min(8, new_tokens), vocab, seed + 100 + i)
                               for i in range(procs)])
            warmup = time.perf_counter() - t0
            shares = [(base, plan[i::procs], rounds, prompt, new_tokens, vocab, seed + i) for i in range(procs)]
            before, cpu0 = _server_stats(base, proc.pid)
            t0 = time.perf_counter()
            parts = pool.map(_client, shares)
            wall = time.perf_counter() - t0
            after, cpu1 = _server_stats(base, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    served = {c: after[c] - before[c] for c in COUNTERS}      # the engine's counters over the timed pass
    ttft = [x for p in parts for x in p["ttft"]]
    itl = [x for p in parts for x in p["itl"]]
    tokens = sum(p["tokens"] for p in parts)
    ms = lambda v, q: float(np.percentile(v, q, method="nearest")) * 1e3 if v else None   # nearest rank
    return {"warmup_s": warmup, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "steps_s": served["decode_steps"] / wall,
            "prefills": served["prefill_forwards"], "captures": served["prefill_graph_captures"],
            "prefill_s": served["prefill_seconds"], "idle_s": served["idle_seconds"],
            "server_cpu": (cpu1[1] - cpu0[1]) / wall, "http_cpu": (cpu1[0] - cpu0[0]) / wall,
            "server_us_per_token": (cpu1[1] - cpu0[1]) / max(tokens, 1) * 1e6,
            "client_cpu": sum(p["cpu"] for p in parts) / wall, "http_stack": http_stack()}


def serve_suite(r, out: list) -> None:
    """Every (mix, streams, server setting) of the config against one server process per entry."""
    cfg = r.cfg
    tiers = sorted({t for m in cfg.serve_mixes for t in m.split(",")}, key=lambda t: r.table[t].index)
    knobs = ("max_prefill", "prefill_wait_ms", "prefill_graphs", "prefill_graph_tokens", "attended_spans")
    for mix, streams, *values in itertools.product(cfg.serve_mixes, cfg.serve_streams,
                                                   *(getattr(cfg, f"serve_{k}") for k in knobs)):
        server = dict(zip(knobs, values))        # the server process's options (BenchServerOptions) of this row
        base = {"bench": "serve", "preset": cfg.preset, "mix": mix, "streams": streams, "slots": cfg.serve_slots,
                **server, "prompt": cfg.serve_prompt, "new_tokens": cfg.serve_new_tokens}
        r.run(out, base, lambda mix=mix, streams=streams, server=server: bench_serve(
            cfg.preset, tiers, mix.split(","), streams, cfg.serve_slots, cfg.serve_prompt, cfg.serve_new_tokens,
            cfg.serve_rounds, cfg.serve_client_procs, str(r.dev), str(r.dtype).replace("torch.", ""), cfg.seed,
            server=server))


# ---- the server process ----------------------------------------------------------------------------------
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

    run_server(derive(BenchServerOptions, argv, "python -m elastic_ssm.bench.serve", __doc__.splitlines()[0]))


if __name__ == "__main__":
    main()
