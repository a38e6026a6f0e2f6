"""The engine in its own process (``serve/remote.py``) and the serve proxy's pool (``benchmarks/serve_stub.StubPool``).

``RemoteEngine`` is driven as the HTTP app drives it (submit, events on the asyncio loop, cancel): greedy text
equals ``model.generate``, a full tier answers ``Busy``, a cancelled request frees its slot, a failed load is
one clear error, and a dead engine process ends the requests in flight.
"""

import asyncio
import functools
import time

import pytest
import torch

import elastic_ssm as es
from benchmarks.serve_stub import StubPool
from elastic_ssm.bench.serve import IdTokenizer
from elastic_ssm.data.tokenizers import resolve_tokenizer
from elastic_ssm.models import load_pretrained
from elastic_ssm.serve.engine import Busy, Engine, Request
from elastic_ssm.serve.remote import RemoteEngine, model_view


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir


async def _run(req: Request) -> tuple[str, list]:
    text, kinds = [], []
    while True:
        kind, value = await req.queue.get()
        req.took()
        kinds.append(kind)
        if kind == "text":
            text.append(value)
        if kind != "text":
            return "".join(text), kinds


def test_remote_engine_serves_cancels_and_bounds_its_queue(model_dir):
    view = model_view(str(model_dir))
    assert view.arch == "essh" and view.tokenizer is not None
    eng = RemoteEngine(functools.partial(load_pretrained, str(model_dir)), view, ["T1", "T10"], slots=1, max_queue=1)

    async def main():
        loop = asyncio.get_running_loop()
        eng.start().attach(loop)

        def make(tier, n, temperature=0.0):
            return Request(tier=tier, prompt=list(b"def f("), max_tokens=n, temperature=temperature, loop=loop,
                           queue=asyncio.Queue())

        greedy = make("T1", 6)
        eng.submit(greedy)
        text, kinds = await _run(greedy)
        assert kinds[-1] == "done" and greedy.finish_reason == "length" and greedy.completion_tokens == 6
        ref = load_pretrained(str(model_dir)).generate(torch.tensor([list(b"def f(")]), max_new_tokens=6, tier="T1")
        assert text == view.tokenizer.decode(ref[0, 6:].tolist())
        long, queued = make("T10", 4000, 0.7), make("T10", 3)
        eng.submit(long)
        eng.submit(queued)                                  # one slot busy, one request waiting: the bound
        with pytest.raises(Busy, match="at capacity"):
            eng.submit(make("T10", 3))
        await long.queue.get()
        long.cancel()                                       # the client left: its slot frees, the queued one runs
        assert (await _run(queued))[1][-1] == "done" and queued.completion_tokens == 3
        assert long.finish_reason == "cancelled" and eng.snapshot()["T10"] == {"slots": 1, "busy": 0, "waiting": 0}
        c = eng.counters()                                  # the engine process's counters came over
        assert c["prefill_forwards"] == 3 and c["decode_steps"] >= 6 + 3 and c["prefill_graph_captures"] == 0
        assert c["prefill_seconds"] > 0 and c["idle_seconds"] >= 0
        stuck = make("T10", 4000, 0.7)
        eng.submit(stuck)
        await stuck.queue.get()
        eng._proc.kill()                                    # the engine process dies: the request ends with an error
        assert (await _run(stuck))[1][-1] == "unavailable" and not eng.alive()     # a 503: retry elsewhere
        with pytest.raises(Busy, match="stopped"):
            eng.submit(make("T1", 1))

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_a_model_saved_without_a_tokenizer_is_served_with_bytes(tmp_path):
    """As ``generate`` and ``eval`` do (``resolve_tokenizer``): a byte-vocabulary model saved from Python without
    a tokenizer is served with the byte tokenizer, which the HTTP side resolves once and sends to the engine
    process (its own load has none); ``--tokenizer`` names another one only for a model saved without one, and
    must match a saved one."""
    torch.manual_seed(0)
    bare = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    bare.save_pretrained(tmp_path / "bare")
    view = model_view(str(tmp_path / "bare"))
    assert view.tokenizer is None and view.tokenizer_record is None
    view.tokenizer = resolve_tokenizer(view, None)
    assert view.tokenizer.spec == "bytes" and view.tokenizer.encode("ab") == [97, 98]
    loaded = load_pretrained(str(tmp_path / "bare"))
    assert loaded.tokenizer is None
    eng = RemoteEngine(functools.partial(load_pretrained, str(tmp_path / "bare")), view, ["T4"], slots=1)

    async def main():
        loop = asyncio.get_running_loop()
        eng.start().attach(loop)
        req = Request(tier="T4", prompt=list(b"def f("), max_tokens=5, temperature=0.0, loop=loop,
                      queue=asyncio.Queue())
        eng.submit(req)
        return await _run(req)

    try:
        text, kinds = asyncio.run(main())
    finally:
        eng.shutdown()
    ref = loaded.generate(torch.tensor([list(b"def f(")]), max_new_tokens=5, tier="T4")
    assert kinds[-1] == "done" and text == view.tokenizer.decode(ref[0, 6:].tolist())


def test_a_failed_load_is_one_clear_error(model_dir, tmp_path):
    eng = RemoteEngine(functools.partial(load_pretrained, str(tmp_path)), model_view(str(model_dir)), ["T1"])
    with pytest.raises(RuntimeError, match="could not start: CheckpointError: .*no config.json"):
        eng.start()


def test_stub_pool_gives_each_stream_its_last_token_plus_one():
    model = es.ESSH(es.ESSHConfig.preset("tiny", vocab_size=1024))
    model.tokenizer = IdTokenizer(1024)
    eng = Engine(model, ["T10"], slots=4, tokenizer=model.tokenizer,
                 pool_factory=functools.partial(StubPool, step_ms=0.0)).start()
    try:
        reqs = [Request(tier="T10", prompt=[p, 1022 - p], max_tokens=3, temperature=0) for p in (0, 5)]
        for r in reqs:
            eng.submit(r)
        deadline = time.monotonic() + 30
        while any(r.finish_reason is None for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.tokens for r in reqs] == [[1023, 0, 1], [1018, 1019, 1020]]
    finally:
        eng.shutdown()


def test_a_signal_to_the_process_group_stops_the_engine_quietly(model_dir, caplog):
    """Ctrl-C (SIGINT to the whole group) is the HTTP process's to handle: the engine process ignores it and is
    stopped by ``shutdown``; a SIGTERM stops it at once, saying so. Each is one info line, never an error."""
    import logging
    import os
    import signal

    view = model_view(str(model_dir))

    async def main(eng):
        loop = asyncio.get_running_loop()
        eng.start().attach(loop)
        req = Request(tier="T1", prompt=list(b"def f("), max_tokens=4000, temperature=0.7, loop=loop,
                      queue=asyncio.Queue())
        eng.submit(req)
        await req.queue.get()
        req.took()
        os.kill(eng._proc.pid, signal.SIGINT)              # the group's Ctrl-C, as the engine process sees it
        await asyncio.sleep(1.0)
        assert eng.alive() and req.finish_reason is None     # still serving
        os.kill(eng._proc.pid, signal.SIGTERM)
        kinds = (await _run(req))[1]
        assert kinds[-1] == "unavailable" and not eng.alive()      # a 503 to the client: retry elsewhere
        eng._proc.join(10)
        assert eng._proc.exitcode == 0                       # ended on its own terms, not killed by the signal

    caplog.set_level(logging.INFO, logger="elastic_ssm.serve")
    eng = RemoteEngine(functools.partial(load_pretrained, str(model_dir)), view, ["T1"], slots=1)
    try:
        asyncio.run(main(eng))
    finally:
        eng.shutdown()
    records = [r for r in caplog.records if r.name == "elastic_ssm.serve"]
    assert [(r.levelname, r.getMessage()) for r in records] == \
        [("INFO", "the engine process stopped (SIGTERM); ending 1 requests in flight")]

    caplog.clear()
    eng = RemoteEngine(functools.partial(load_pretrained, str(model_dir)), view, ["T1"], slots=1)

    async def interrupted():
        eng.start().attach(asyncio.get_running_loop())
        os.kill(eng._proc.pid, signal.SIGINT)
        await asyncio.sleep(0.5)
        assert eng.alive()
        eng.shutdown()
        eng.shutdown()                                       # the lifespan and the command both call it: said once

    asyncio.run(interrupted())
    assert eng._proc.exitcode == 0
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "elastic_ssm.serve"] == \
        [("INFO", "the engine process stopped (server shutdown)")]
