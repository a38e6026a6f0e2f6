"""Run a script's Triton kernels on CPU tensors: a subprocess with ``TRITON_INTERPRET=1`` (it must be set
before triton is imported). Tests skip with a reason where triton is not installed (the dev extra installs
it on Linux x86-64, so CI runs them)."""

import os
import subprocess
import sys

import pytest


def run_interpreted(code: str, timeout: int = 300) -> None:
    """Execute ``code`` (which prints ``ok`` last on success) under the Triton interpreter; assert success."""
    pytest.importorskip("triton", reason="optional: runs the Triton kernels on CPU via TRITON_INTERPRET")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
