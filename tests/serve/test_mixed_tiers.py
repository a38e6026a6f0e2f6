"""Every tier in one decode batch (CPU, float32): the slot pool and the engine run rows of T1, T4 and T10 in one
step, and every request's greedy text equals ``model.generate(..., tier=its tier)`` alone, with rows joining and
leaving, left-padded batched prefills, and slots reused at another tier. The engine counts one decode step per
token position, not one per tier."""

import importlib

import pytest
import torch
from served import greedy_rows, run_to_completion

from elastic_ssm.serve.engine import Engine, Request
from elastic_ssm.serve.slots import SlotPool

TIERS = ("T1", "T4", "T10")


def _alone(model, prompt: list[int], tier: str, n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), n, tier=tier)[0, len(prompt):].tolist()


def _requests(k: int):
    """k prompts of varied lengths, cycling over T1, T4, T10 (bytes of the ``tiny`` byte tokenizer)."""
    words = [b"hello", b"the quick brown fox", b"0123", b"elastic spectral", b"zz", b"abcdefghij", b"q", b"mixed"]
    return [(list(words[i % len(words)]) + [i], TIERS[i % 3]) for i in range(k)]


@torch.no_grad()
def test_pool_rows_of_three_tiers_join_and_leave_and_each_equals_generate_alone(tiny):
    n = 10
    reqs = _requests(7)
    want = [_alone(tiny, p, t, n) for p, t in reqs]
    assert len({tuple(w) for w in want}) == len(want)
    pool = SlotPool(tiny, list(TIERS), 4, max_prefill=4)
    assert pool.tier.name == "T10" and pool.fd.mixed
    got: dict[int, list[int]] = {}
    waiting, rows, step = list(range(len(reqs))), {}, 0
    while waiting or pool.busy():
        if waiting and step % 3 == 0 and pool.free_slots():
            take = waiting[:min(2, pool.free_slots())]
            by_tier: dict[str, list[int]] = {}
            for k in take:
                by_tier.setdefault(reqs[k][1], []).append(k)
            for tier, ks in by_tier.items():         # left-padded together when two of one tier join at once
                for k, row in zip(ks, pool.admit_many(ks, [reqs[k][0] for k in ks], tier)):
                    rows[row], got[k] = k, []
            waiting = waiting[len(take):]
        tokens = pool.logits.argmax(-1)
        for row in pool.active_rows():
            got[rows[row]].append(int(tokens[row]))
            if len(got[rows[row]]) == n:
                pool.release(row)
        pool.step(tokens)
        step += 1
    assert [got[k] for k in range(len(reqs))] == want


@torch.no_grad()
def test_a_slot_reused_at_a_narrower_tier_through_the_scratch_cache(tiny):
    """Scattered free rows: the prefill runs at the widest tier (row factors) through its scratch cache and is
    copied into the slots, their channels past K_T zeroed; the text equals generate alone."""
    pool = SlotPool(tiny, ["T1", "T10"], 3)
    for _ in range(3):
        pool.admit("busy", list(b"long prompt at T10"), "T10")
    for _ in range(4):
        pool.step(pool.logits.argmax(-1))
    pool.release(0)
    pool.release(2)                                      # rows 0 and 2: not consecutive
    prompts = [list(b"abc"), list(b"defgh")]
    rows = pool.admit_many(["a", "b"], prompts, "T1")
    assert rows == [0, 2] and pool._scratch.tier == tiny.resolve_tier("T10")     # one scratch cache, the widest
    for s in pool.cache.states.values():
        assert not s[rows, tiny.resolve_tier("T1").K:].any()
    assert greedy_rows(pool, rows, 8) == [_alone(tiny, p, "T1", 8) for p in prompts]


def test_engine_serves_three_tiers_in_one_step_per_token_position(tiny):
    n, reqs = 6, _requests(6)
    eng = Engine(tiny, list(TIERS), slots=8, tokenizer=tiny.tokenizer, prefill_wait_ms=0)
    live = [Request(tier=t, prompt=p, max_tokens=n, temperature=0) for p, t in reqs]
    run_to_completion(eng, live, timeout=60)
    assert [r.finish_reason for r in live] == ["length"] * len(live)
    assert [r.tokens for r in live] == [_alone(tiny, p, t, n) for p, t in reqs]
    assert eng.counters()["decode_steps"] == n          # six rows at three tiers: one step per position
    assert eng.counters()["prefill_forwards"] == 1      # six prompts at three tiers: one left-padded forward


@torch.no_grad()
def test_one_prefill_of_prompts_at_three_tiers_equals_each_generate_alone(tiny):
    """``admit_many`` with one tier per prompt: one left-padded forward at the widest tier (row factors), in place and
    through the scratch cache, the graphs' static-buffer path too; every row's text equals generate alone."""
    reqs = _requests(6)
    for graphs in (False, True):
        pool = SlotPool(tiny, list(TIERS), 8, max_prefill=6, prefill_graphs=graphs, graph_after=1)
        pool.admit("busy", list(b"keeps row 0 busy"), "T4")          # the six go to rows 1-6 (in place)
        rows = pool.admit_many(list(range(6)), [p for p, _ in reqs], [t for _, t in reqs])
        assert rows == list(range(1, 7)) and [pool.row_tier[r].name for r in rows] == [t for _, t in reqs]
        # graphs: the busy row's and one for the six prompts at three tiers (one graph serves every mix)
        assert sorted(k[1] for k in pool._graphs) == ([1, 6] if graphs else [])
        assert greedy_rows(pool, rows, 6) == [_alone(tiny, p, t, 6) for p, t in reqs]
    with pytest.raises(ValueError, match="2 tiers for 3 prompts"):
        pool.admit_many([0, 1, 2], [[1], [2], [3]], ["T1", "T4"])


@torch.no_grad()
def test_the_eager_prefill_takes_no_host_sync_per_layer(tiny, monkeypatch):
    """The pool's eager prefill scans inside ``sync_free`` (no ``isolate_nonfinite``: one host sync per layer on
    CUDA, which kept the GPU waiting for the CPU between layers); its rows still equal generate alone."""
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    calls, real = [], ct.isolate_nonfinite
    monkeypatch.setattr(ct, "isolate_nonfinite", lambda *a: calls.append(1) or real(*a))
    reqs = _requests(4)
    pool = SlotPool(tiny, list(TIERS), 4, max_prefill=4, prefill_graphs=False)
    rows = pool.admit_many(list(range(4)), [p for p, _ in reqs], [t for _, t in reqs])
    assert calls == []
    tiny.hidden_states(torch.tensor([list(b"outside the pool")]))
    assert calls                                   # the check the pool skips runs in a plain forward
    assert greedy_rows(pool, rows, 6) == [_alone(tiny, p, t, 6) for p, t in reqs]
