"""The serve benchmark end to end on the CPU (its proxy, ``benchmarks/serve_stub.py``: a real server process whose
pools are ``StubPool``s with a fixed step time, and the real load generator): every stream gets its tokens, and the
row splits the server's time with the engine's counters (``/metrics``) and the CPU of its processes."""

import sys

import pytest

from benchmarks.serve_stub import StubServerOptions
from elastic_ssm.bench.serve import bench_serve


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the server's CPU")
def test_proxy_row_counts_every_token_and_splits_the_servers_time():
    stub = {"stub_step_ms": 2, "stub_prefill_ms": 20, "max_prefill": 8}
    streams, new_tokens, rounds = 8, 16, 2
    row = bench_serve("tiny", ["T10"], ["T10"], streams, 8, 12, new_tokens, rounds, 2, "cpu", "float32",
                      server=stub, server_class=StubServerOptions)
    assert row["tokens"] == streams * new_tokens * rounds and row["tok_s"] > 0
    assert row["steps_s"] * row["wall_s"] >= new_tokens * rounds - 1          # every round decodes 16 steps
    assert 1 <= row["prefills"] <= streams * rounds and row["captures"] == 0   # no CUDA graphs on the CPU
    assert 0 <= row["prefill_s"] < row["wall_s"] and 0 <= row["idle_s"] < row["wall_s"]
    assert 0 <= row["http_cpu"] <= row["server_cpu"] + 1e-6      # CPU in 10 ms ticks: the engine may show none
    assert row["http_stack"].startswith("event loop ") and ", HTTP " in row["http_stack"]


def test_proxy_rows_name_the_servers_loop_and_parser_as_set():
    """``--server.loop`` / ``--server.http`` given: the row's ``http_stack`` names them, not uvicorn's auto pick."""
    from elastic_ssm.serve.cli import http_stack

    assert StubServerOptions().stack == http_stack()
    assert StubServerOptions(loop="asyncio", http="h11").stack == "event loop asyncio, HTTP h11"
    assert StubServerOptions(http="h11").stack.endswith(", HTTP h11")
