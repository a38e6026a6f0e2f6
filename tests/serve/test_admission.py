"""Coalescing admission (``Engine(prefill_wait_ms=W)``): a burst of arrivals is prefilled in one forward, a lone
request waits until arrivals pause ``PREFILL_GAP_MS`` (at most W), running rows keep decoding meanwhile, W=0 admits
at once.

The engine reads admission time through an injected fake clock and the tests drive ``Engine._tick`` by hand (no
engine thread), so every assertion is on counts and group sizes at chosen clock values, never on wall time. The
pool is the serve proxy's ``StubPool`` (``benchmarks/serve_stub.py``) with free decode steps and prefills (its
greedy text: last token + 1).
"""

import functools
import math
import time

import pytest

from benchmarks.serve_stub import StubPool
from elastic_ssm.serve.engine import COUNTERS, PREFILL_GAP_MS, Engine, Request
from elastic_ssm.serve.remote import RemoteEngine

STUB = functools.partial(StubPool, step_ms=0.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _engine(tiny, wait_ms: float, slots: int = 8, max_prefill: int = 8, clock=None):
    """An engine over one stub pool whose ``groups`` list records the size of every prefill forward."""
    eng = Engine(tiny, ["T4"], slots=slots, tokenizer=tiny.tokenizer, pool_factory=STUB, max_prefill=max_prefill,
                 prefill_wait_ms=wait_ms, clock=clock or time.monotonic)
    pool = eng.pool
    eng.groups, admit_many = [], pool.admit_many          # StubPool.admit goes through admit_many too
    pool.admit_many = lambda owners, prompts, tier=None: eng.groups.append(len(prompts)) or admit_many(owners, prompts,
                                                                                                        tier)
    return eng


def _req(max_tokens: int = 4, prompt=(1, 2, 3)) -> Request:
    return Request(tier="T4", prompt=list(prompt), max_tokens=max_tokens, temperature=0.0)


def test_a_burst_over_a_few_ms_is_admitted_in_one_forward_when_it_fills_the_free_slots(tiny):
    clock = FakeClock()
    eng = _engine(tiny, wait_ms=50, clock=clock)
    reqs = [_req() for _ in range(8)]
    for k, (i, j) in enumerate([(0, 3), (3, 6), (6, 8)]):      # 3, 3 and 2 arrivals, 2 ms apart
        clock.t = 100.0 + 0.002 * k
        for r in reqs[i:j]:
            eng.submit(r)
        eng._tick()
        assert eng.groups == ([] if j < 8 else [8])
    assert all(r.completion_tokens == 1 for r in reqs)        # admitted and given their first token in that tick
    assert eng._idle_for() == 0                              # rows run: the loop never sleeps
    c = eng.counters()                                       # one step, one prefill forward, no graph (CPU)
    assert (c["decode_steps"], c["prefill_forwards"], c["prefill_graph_captures"]) == (1, 1, 0)
    assert set(c) == set(COUNTERS) and c["prefill_seconds"] > 0


def test_a_lone_request_waits_for_a_pause_in_arrivals_and_the_idle_loop_sleeps_until_then(tiny):
    clock = FakeClock()
    gap = PREFILL_GAP_MS / 1e3
    eng = _engine(tiny, wait_ms=50, clock=clock)
    assert eng._idle_for() is None                           # nothing to do: sleep until notified
    lone = _req()
    eng.submit(lone)
    for t in (0.0, gap / 2, gap - 1e-4):
        clock.t = 100.0 + t
        assert eng._idle_for() == pytest.approx(gap - t)     # what the loop sleeps on its condition variable
        eng._tick()
        assert eng.groups == [] and lone.completion_tokens == 0
    clock.t = 100.0 + gap
    assert eng._idle_for() == 0
    eng._tick()
    assert eng.groups == [1] and lone.completion_tokens == 1


def test_a_burst_that_keeps_arriving_waits_for_its_pause_but_at_most_the_wait(tiny):
    """Arrivals closer than the gap hold the forming batch (one forward for the wave), up to W after the first."""
    clock, gap = FakeClock(), PREFILL_GAP_MS / 1e3
    eng = _engine(tiny, wait_ms=50, slots=16, max_prefill=16, clock=clock)
    for k in range(4):                                       # 4 arrivals, gap/2 apart: one forward after the pause
        clock.t = 100.0 + k * gap / 2
        eng.submit(_req(max_tokens=100))
        eng._tick()
    assert eng.groups == []
    clock.t += gap
    eng._tick()
    assert eng.groups == [4]
    t0, k = clock.t + 1.0, 0
    while not eng.groups[1:]:                                # a steady trickle: cut at W = 50 ms after its first
        clock.t = t0 + k * gap / 2
        eng.submit(_req())
        eng._tick()
        k += 1
    assert clock.t - t0 == pytest.approx(0.05) and eng.groups == [4, 11]


def test_running_rows_keep_decoding_while_admission_waits(tiny):
    clock = FakeClock()
    eng = _engine(tiny, wait_ms=50, clock=clock)
    running = [_req(max_tokens=100) for _ in range(2)]
    for r in running:
        eng.submit(r)
    clock.t = 100.05
    eng._tick()                                          # the two waited: admitted together
    assert eng.groups == [2]
    late = [_req(), _req()]
    steps = eng.counters()["decode_steps"]
    for k in range(5):                                       # arrivals 1 ms apart: decode, no prefill
        clock.t = 101.0 + 0.001 * k
        if k < 2:
            eng.submit(late[k])
        eng._tick()
    assert eng.counters()["decode_steps"] == steps + 5 and [r.completion_tokens for r in running] == [6, 6]
    assert eng.groups == [2] and late[0].completion_tokens == 0
    clock.t = 101.001 + PREFILL_GAP_MS / 1e3
    eng._tick()
    assert eng.groups == [2, 2] and late[0].completion_tokens == 1 and running[0].completion_tokens == 7


def test_the_preferred_batch_is_what_fits_max_prefill_and_the_free_slots(tiny):
    clock = FakeClock()
    eng = _engine(tiny, wait_ms=50, slots=8, max_prefill=3, clock=clock)
    for _ in range(3):
        eng.submit(_req(max_tokens=100))
    eng._tick()                                          # 3 = max_prefill waiting: at once
    assert eng.groups == [3]
    for _ in range(5):                                       # 5 free slots, 5 waiting: at once (3 + 2)
        eng.submit(_req())
    eng._tick()
    assert eng.groups == [3, 3, 2]


def test_a_waiting_request_whose_client_left_gives_its_place_back_at_the_next_step(tiny):
    """Every slot busy and the queue full: a queued request cancelled (its client gone) ended only when a slot
    freed, so the server answered 503 meanwhile and /health counted it waiting."""
    eng = _engine(tiny, wait_ms=0, slots=1)
    eng.max_queue = 1
    eng.submit(running := _req(max_tokens=100))
    eng._tick()
    eng.submit(queued := _req())
    queued.cancel()
    eng._tick()
    assert queued.finish_reason == "cancelled" and eng.snapshot()["T4"] == {"slots": 1, "busy": 1, "waiting": 0}
    eng.submit(_req())                                       # its place is free again: no Busy
    assert running.finish_reason is None


def test_zero_wait_admits_whatever_waits_at_once(tiny):
    clock = FakeClock()
    eng = _engine(tiny, wait_ms=0, clock=clock)
    first = _req(max_tokens=100)
    eng.submit(first)
    eng._tick()
    assert eng.groups == [1] and first.completion_tokens == 1
    for _ in range(2):
        eng.submit(_req())
    eng._tick()                                          # same clock: nothing waits for more
    assert eng.groups == [1, 2]


def test_the_engine_thread_admits_a_burst_together_as_soon_as_it_fills_the_slots(tiny):
    """Real clock, running loop: with a 30 s wait the four requests can only finish within the 20 s below if the
    fourth arrival wakes the sleeping loop, and they were then prefilled together."""
    eng = _engine(tiny, wait_ms=30_000, slots=4, max_prefill=4).start()
    reqs = [_req() for _ in range(4)]
    try:
        for r in reqs:
            eng.submit(r)
            time.sleep(0.005)
        deadline = time.time() + 20
        while any(r.finish_reason is None for r in reqs) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        eng.shutdown()
    assert eng.groups == [4] and [r.finish_reason for r in reqs] == ["length"] * 4


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "5", None, True])
def test_a_bad_wait_is_a_one_line_error(tiny, bad):
    with pytest.raises(ValueError, match=r"prefill_wait_ms must be a finite number of milliseconds >= 0"):
        Engine(tiny, ["T4"], slots=2, pool_factory=STUB, prefill_wait_ms=bad)
    with pytest.raises(ValueError, match="prefill_wait_ms"):          # before any engine process starts
        RemoteEngine(lambda: tiny, tiny, ["T4"], slots=2, prefill_wait_ms=bad)


def test_the_defaults_of_the_flag_the_settings_and_the_bench_agree():
    import dataclasses

    from elastic_ssm.bench import BenchConfig
    from elastic_ssm.cli_schema import ServeOptions
    from elastic_ssm.serve.app import ServerSettings
    from elastic_ssm.serve.engine import PREFILL_WAIT_MS

    flag = {f.name: f.default for f in dataclasses.fields(ServeOptions)}["prefill_wait_ms"]
    assert flag == ServerSettings(name="m", tiers=["T1"], default_tier="T1").prefill_wait_ms == PREFILL_WAIT_MS
    assert BenchConfig().serve_prefill_wait_ms == (PREFILL_WAIT_MS,)
    from elastic_ssm.serve.slots import GRAPH_TOKENS

    tokens = {f.name: f.default for f in dataclasses.fields(ServeOptions)}["prefill_graph_tokens"]
    assert tokens == ServerSettings(name="m", tiers=["T1"], default_tier="T1").prefill_graph_tokens == GRAPH_TOKENS
    assert BenchConfig().serve_prefill_graph_tokens == (GRAPH_TOKENS,)
    assert ServerSettings(name="m", tiers=["T1"], default_tier="T1").engine_options()["prefill_graph_tokens"] == 2048


def test_prefill_graph_tokens_reach_the_pools_and_bad_values_are_refused(tiny):
    assert Engine(tiny, ["T4"], slots=2, prefill_graph_tokens=512).pool.max_graph_tokens == 512
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_graph_tokens must be an int >= 1"):
            Engine(tiny, ["T4"], slots=2, prefill_graph_tokens=bad)
