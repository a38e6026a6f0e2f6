"""A real ``elastic-ssm serve`` process for the tests that talk to it over sockets: started on a free port, waited
for until ``/health`` answers, terminated (its output printed) at the end."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ssm.bench.serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serve_process(model_dir, *flags: str):
    """``elastic-ssm serve model_dir --port <free> --device cpu *flags``; yields the port."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ssm.cli", "serve", str(model_dir), "--port", str(port),
                             "--device", "cpu", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if not wait_healthy(f"http://127.0.0.1:{port}", proc, 60):
        pytest.fail(f"the server did not start:\n{proc.communicate()[0]}")
    try:
        yield port
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        print(out)


def run_to_completion(engine, requests, timeout: float) -> None:
    """Queue every request before the engine's loop starts (so one admission round sees them all), start it, wait
    until each request has a finish reason or ``timeout`` seconds passed, and shut the engine down."""
    for r in requests:
        engine.submit(r)
    engine.start()
    try:
        deadline = time.time() + timeout
        while any(r.finish_reason is None for r in requests) and time.time() < deadline:
            time.sleep(0.02)
    finally:
        engine.shutdown()


def greedy_rows(pool, rows, n):
    """``n`` greedy tokens of each of ``rows`` of ``pool``, stepping the whole pool."""
    out = {r: [] for r in rows}
    for _ in range(n):
        tokens = pool.logits.argmax(-1)
        for r in rows:
            out[r].append(int(tokens[r]))
        pool.step(tokens)
    return [out[r] for r in rows]
