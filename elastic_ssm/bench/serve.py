"""``elastic-ssm bench`` ``serve`` entry: N concurrent streams against a real ``elastic-ssm serve`` process.

The server runs in its own process (``python -m elastic_ssm.bench.serve``: the served app of
``serve/app.py`` over a random-weight ESSH at the bench preset, every tier of ``serve_tiers`` with
``serve_slots`` slots, no weights on disk). Its tokenizer is ``IdTokenizer``: one character per token id,
so every streamed character is one token. Load comes from ``serve_client_procs`` client processes (a
Python client cannot read tens of thousands of server-sent events a second alone), each running its share
of the streams with ``httpx``: every stream sends ``serve_rounds`` requests one after another (a prompt of
``serve_prompt`` random ids, greedy, ``serve_new_tokens`` tokens, streamed), the streams' tiers cycling
through the mix. A warm-up pass (every stream once, 8 tokens) runs first and is reported as ``warmup_s``.
Reported per (mix, streams): aggregate generated tokens/s over the run's wall clock,
p50/p99 time to first token, p50/p99 inter-token latency (gaps between streamed chunks), and the
issue's targets beside them (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time

from .timing import percentile

__all__ = ["IdTokenizer", "serve_suite", "bench_serve", "wait_healthy", "free_port"]


class IdTokenizer:
    """A stand-in tokenizer for random-weight models: token i <-> the character U+0100 + i (no specials)."""

    pad_id = bos_id = eos_id = sep_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text if 0 <= ord(c) - 0x100 < self.vocab_size]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + int(i)) for i in ids)


def _client(args: tuple) -> dict:
    """One client process: its streams, run concurrently; returns raw timings."""
    import asyncio

    import httpx

    base, streams, rounds, prompt, new_tokens, vocab, seed = args

    async def one(client, tier: str, rng) -> tuple[list, list, int]:
        ttft, itl, tokens = [], [], 0
        for _ in range(rounds):
            body = {"model": f"bench@{tier}", "prompt": [rng.randrange(vocab) for _ in range(prompt)],
                    "max_tokens": new_tokens, "temperature": 0, "stream": True}
            t0 = last = time.perf_counter()
            first = True
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"server answered {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    n = len(choices[0].get("text") or "")
                    if n == 0:
                        continue
                    (ttft.append(now - t0) if first else itl.append(now - last))
                    first, last = False, now
                    tokens += n
        return ttft, itl, tokens

    async def main() -> dict:
        import random

        limits = httpx.Limits(max_connections=len(streams) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            res = await asyncio.gather(*(one(client, t, random.Random(seed * 1000 + i)) for i, t in enumerate(streams)))
        return {"ttft": [x for r in res for x in r[0]], "itl": [x for r in res for x in r[1]],
                "tokens": sum(r[2] for r in res)}

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


def bench_serve(preset: str, tiers: list[str], mix: list[str], streams: int, slots: int, prompt: int,
                new_tokens: int, rounds: int, procs: int, device: str, dtype: str, seed: int = 0) -> dict:
    """Start the server process, drive ``streams`` streams over the tiers of ``mix``, return the row."""
    from ..config import ESSHConfig

    vocab = ESSHConfig.preset(preset).vocab_size
    port = free_port()
    cmd = [sys.executable, "-m", "elastic_ssm.bench.serve", "--preset", preset, "--tiers", ",".join(tiers),
           "--slots", str(slots), "--port", str(port), "--device", device, "--dtype", dtype, "--seed", str(seed)]
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
            # warm-up: the same streams once with a few tokens, so that first-use costs (fla's autotuning of the
            # prefill shapes, CUDA context of the clients) are reported apart from the served rate
            t0 = time.perf_counter()
            pool.map(_client, [(base, plan[i::procs], 1, prompt, min(8, new_tokens), vocab, seed + 100 + i)
                               for i in range(procs)])
            warmup = time.perf_counter() - t0
            shares = [(base, plan[i::procs], rounds, prompt, new_tokens, vocab, seed + i) for i in range(procs)]
            t0 = time.perf_counter()
            parts = pool.map(_client, shares)
            wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    ttft = [x for p in parts for x in p["ttft"]]
    itl = [x for p in parts for x in p["itl"]]
    tokens = sum(p["tokens"] for p in parts)
    ms = lambda v: None if v is None else v * 1e3
    return {"warmup_s": warmup, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(itl, 50)),
            "itl_p99_ms": ms(percentile(itl, 99))}


def serve_suite(r, out: list) -> None:
    """Every (mix, streams) of the config against one server process per entry."""
    cfg = r.cfg
    tiers = sorted({t for m in cfg.serve_mixes for t in m.split(",")}, key=lambda t: r.table[t].index)
    for mix in cfg.serve_mixes:
        for streams in cfg.serve_streams:
            base = {"bench": "serve", "preset": cfg.preset, "mix": mix, "streams": streams, "slots": cfg.serve_slots,
                    "prompt": cfg.serve_prompt, "new_tokens": cfg.serve_new_tokens}
            r.run(out, base, lambda mix=mix, streams=streams: bench_serve(
                cfg.preset, tiers, mix.split(","), streams, cfg.serve_slots, cfg.serve_prompt, cfg.serve_new_tokens,
                cfg.serve_rounds, cfg.serve_client_procs, str(r.dev), str(r.dtype).replace("torch.", ""), cfg.seed))


def _serve_main(argv: list[str] | None = None) -> None:
    """The server process of the benchmark (random weights, ``IdTokenizer``)."""
    import torch
    import uvicorn

    from ..config import ESSHConfig
    from ..serve.app import ServerSettings, create_app
    from .peers import build_essh

    p = argparse.ArgumentParser(prog="python -m elastic_ssm.bench.serve")
    p.add_argument("--preset", required=True)
    p.add_argument("--tiers", required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    model = build_essh(ESSHConfig.preset(a.preset), torch.device(a.device), getattr(torch, a.dtype))
    model.tokenizer = IdTokenizer(model.config.vocab_size)
    tiers = a.tiers.split(",")
    settings = ServerSettings(name="bench", tiers=tiers, default_tier=tiers[-1], slots=a.slots,
                              max_queue=4 * a.slots, max_connections_per_client=1 << 16, max_prompt_tokens=1 << 16,
                              max_tokens_limit=1 << 16)
    uvicorn.run(create_app(model, settings), host="127.0.0.1", port=a.port, log_level="warning",
                limit_concurrency=1 << 16)


if __name__ == "__main__":
    _serve_main()
