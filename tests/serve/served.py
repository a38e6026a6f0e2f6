"""A real ``elastic-ssm serve`` process for the tests that talk to it over sockets: started on a free port, waited
for until ``/health`` answers, terminated (its output printed) at the end."""

import contextlib
import os
import subprocess
import sys
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
