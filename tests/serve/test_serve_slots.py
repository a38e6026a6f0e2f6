"""Serving's slot pool without HTTP: a slot row's view and reset, the pool against generate (staggered arrivals, the
attended span), prefill groups, warm-up, and the graphed prefill (graphs per shape, a failed capture, the bound)."""


import pytest
import torch
from served import greedy_rows

from elastic_ssm.serve.slots import SlotPool, prefill_groups, reset_row_, row_cache
from elastic_ssm.serve.tokens import sample_rows


def test_row_view_writes_one_row_and_reset_empties_only_it(tiny):
    cache = tiny.allocate_cache(3, "T4")
    for t in cache.tensors():
        t.fill_(7)
    view = reset_row_(cache, 1)
    assert view.batch == 1 and view.positions.data_ptr() == cache.positions[1:].data_ptr()
    assert int(cache.positions[1]) == 0 and int(cache.positions[0]) == 7 and int(cache.positions[2]) == 7
    for s in cache.states.values():
        assert s[1].abs().sum() == 0 and (s[0] == 7).all() and (s[2] == 7).all()
    for r in cache.rings.values():
        assert (r.slot_pos[1] == -1).all() and (r.slot_pos[0] == 7).all() and (r.keys[1] == 0).all()
    with pytest.raises(IndexError, match="outside"):
        row_cache(cache, 3)


@pytest.mark.parametrize("tier", ["T1", "T10"])
def test_pool_with_staggered_arrivals_equals_one_at_a_time_generate(tiny, tier):
    prompts = [list(b"hello world"), list(b"abc"), list(b"the quick brown fox jumps"), list(b"z")]
    n = 24
    ref = [tiny.generate(torch.tensor([p]), n, tier=tier)[0, len(p):].tolist() for p in prompts]
    pool = SlotPool(tiny, tier, 4)
    out, waiting, step = {}, list(enumerate(prompts)), 0
    zeros = torch.zeros(4)
    while waiting or pool.busy():
        if waiting and step % 5 == 0:                  # a new request joins a running batch every 5 steps
            k, p = waiting.pop(0)
            pool.admit(k, p)
            out[k] = []
        tokens = sample_rows(pool.logits, zeros, torch.zeros(4, dtype=torch.long), torch.ones(4), None)
        for r in pool.active_rows():
            out[pool.owner[r]].append(int(tokens[r]))
            if len(out[pool.owner[r]]) == n:
                pool.release(r)                        # the freed row is reused by a later arrival
        pool.step(tokens)
        step += 1
    assert [out[k] for k in range(len(prompts))] == ref


def test_pool_attends_the_span_of_its_longest_running_row(tiny):
    """Each step passes the longest running row's length + 1 as the decoder's span (free rows, whatever their
    stale length, do not count); with the tiny window of 16 and spans of 4 and 8 the rows cross both and the
    whole ring, and decode as one-at-a-time ``generate`` does."""
    prompts = [list(b"ab"), list(b"x"), list(b"hey")]
    n = 16
    ref = [tiny.generate(torch.tensor([p]), n, tier="T4")[0, len(p):].tolist() for p in prompts]
    pool = SlotPool(tiny, "T4", 4, min_span=4)
    assert pool.fd.spans == [4, 8]
    pool.owner[3], pool.row_pos[3] = None, 1000                 # a free row with a stale length: not counted
    asked, step = [], pool.fd.step
    pool.fd.step = lambda tokens, span=None: asked.append(span) or step(tokens, span=span)
    out, waiting, k = {}, list(enumerate(prompts)), 0
    while waiting or pool.busy():
        if waiting and k % 3 == 0:
            i, p = waiting.pop(0)
            pool.admit(i, p)
            out[i] = []
        tokens = pool.logits.argmax(-1)
        for r in pool.active_rows():
            out[pool.owner[r]].append(int(tokens[r]))
            if len(out[pool.owner[r]]) == n:
                pool.release(r)
        active = pool.active_rows()
        pool.step(tokens)
        assert asked[-1] == (max(pool.row_pos[r] for r in active) if active else None)   # length + 1, stepped
        k += 1
    assert [out[i] for i in range(3)] == ref
    assert {pool.fd.span_for(s) for s in asked} == {4, 8, None}


def test_prefill_groups_bound_size_and_padding():
    lengths = [9, 40, 9, 10, 9, 41, 300, 9, 12]
    groups = prefill_groups(lengths, max_prefill=4)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))      # every prompt, once
    for g in groups:
        real, padded = sum(lengths[i] for i in g), len(g) * max(lengths[i] for i in g)
        assert len(g) <= 4 and (padded <= 1.25 * real or padded - real <= 2048)
    assert [sorted(lengths[i] for i in g) for g in groups] == [[9, 9, 9, 9], [10, 12, 40, 41], [300]]
    tight = prefill_groups(lengths, max_prefill=8, pad_tokens=0)               # by the ratio alone
    assert [sorted(lengths[i] for i in g) for g in tight] == [[9, 9, 9, 9, 10, 12], [40, 41], [300]]
    assert prefill_groups([7] * 5, 2) == [[0, 1], [2, 3], [4]]                  # one length: by max_prefill
    assert prefill_groups([7] * 5, 8, max_tokens=21) == [[0, 1, 2], [3, 4]]     # and by padded tokens
    assert prefill_groups([5, 50, 6], 8, max_tokens=20) == [[0, 2], [1]]       # a longer prompt goes alone


def test_prompts_of_different_lengths_prefilled_together_equal_generate(tiny):
    """``admit_many`` left-pads prompts of different lengths into one masked forward; every row then decodes
    as ``generate`` does for its prompt alone (greedy), including into scattered rows (the scratch cache)."""
    prompts = [list(b"hi"), list(b"hello there"), list(b"abcdef"), list(b"a somewhat longer prompt")]
    n = 10
    ref = [tiny.generate(torch.tensor([p]), n, tier="T4")[0, len(p):].tolist() for p in prompts]
    for busy in ((), (1, 3)):
        pool = SlotPool(tiny, "T4", 8, max_prefill=4)
        for r in busy:
            pool.owner[r] = "other"
        rows = pool.admit_many(list(range(4)), prompts)
        assert len(set(rows)) == 4 and not set(rows) & set(busy)
        assert greedy_rows(pool, rows, n) == ref, busy
    with pytest.raises(ValueError, match="non-empty"):
        SlotPool(tiny, "T4", 4).admit_many(["a", "b"], [[1, 2], []])


@pytest.mark.parametrize("where", ["/site-packages/fla/ops/gla/chunk.py", "/site-packages/torch/_inductor/lowering.py"])
def test_a_failing_warm_up_names_the_tier_the_length_and_the_torch_scan(tiny, monkeypatch, where):
    """A kernel that fails in the warm-up prefill (an H200 with fla-core 0.6.0 once stopped at 32 tokens with "CUDA
    error: misaligned address") is one line naming the tier and the prompt length, and, when the failure was
    raised inside fla, ``ELASTIC_SSM_SCAN_BACKEND``: an error raised elsewhere (inductor lowering flex_attention
    for 8-wide heads, eighteenth session) is not one the torch scan goes around."""
    pool = SlotPool(tiny, "T4", 2)
    kernel = {}
    exec(compile("def kernel():\n    raise RuntimeError('CUDA error: misaligned address\\nSearch for ...')\n",
                 where, "exec"), kernel)

    def fails(ids, **kw):
        if ids.shape[1] == 64:
            kernel["kernel"]()
        return torch.zeros(1)

    monkeypatch.setattr(tiny, "hidden_states", fails)
    with pytest.raises(RuntimeError) as e:
        pool.warm_up()
    msg = str(e.value)
    assert "\n" not in msg and "tier T4" in msg and "64 tokens" in msg and "misaligned address" in msg
    assert ("ELASTIC_SSM_SCAN_BACKEND=torch" in msg) == ("/fla/" in where)


def test_warm_up_prefills_a_free_row_and_leaves_it_empty(tiny):
    """``SlotPool.warm_up`` (run at construction on CUDA): a busy row decodes on as if nothing happened, and the
    warmed row is left empty (zero state and ring, position 0)."""
    prompt, n = list(b"hello world"), 12
    ref = tiny.generate(torch.tensor([prompt]), n, tier="T4")[0, len(prompt):].tolist()
    pool = SlotPool(tiny, "T4", 3)
    pool.admit("a", prompt)
    pool.warm_up()
    warmed = row_cache(pool.cache, 1)
    assert int(warmed.positions[0]) == 0 and all(not t.any() for t in warmed.tensors() if t.is_floating_point())
    out = []
    for _ in range(n):
        tok = pool.logits[0].argmax()
        out.append(int(tok))
        pool.step(torch.full((3,), int(tok)))
    assert out == ref
    full = SlotPool(tiny, "T4", 1)
    full.admit("b", prompt)
    with pytest.raises(RuntimeError, match="free slot"):
        full.warm_up()


@pytest.mark.parametrize("busy,rows", [((0,), [1, 2, 3]), ((0, 2), [1, 3, 4])])
def test_a_burst_of_equal_length_prompts_is_prefilled_together(tiny, busy, rows):
    """Into consecutive free rows directly (no scratch cache), or through the scratch cache when they are not."""
    prompts = [list(b"abcdefg"), list(b"0123456"), list(b"zzzzzzz")]
    n = 16
    ref = [tiny.generate(torch.tensor([p]), n, tier="T4")[0, len(p):].tolist() for p in prompts]
    pool = SlotPool(tiny, "T4", 5, max_prefill=4)
    for i in range(max(busy) + 1):                         # requests in rows 0..max(busy); then the others leave
        assert pool.admit("x", list(b"hello")) == i
    for i in set(range(max(busy) + 1)) - set(busy):
        pool.release(i)
    before = [t[list(busy)].clone() for t in pool.cache.tensors()]
    assert pool.admit_many([0, 1, 2], prompts) == rows
    assert all(torch.equal(b, t[list(busy)]) for b, t in zip(before, pool.cache.tensors()))   # busy rows untouched
    assert (pool._scratch is None) == (rows == list(range(rows[0], rows[0] + 3)))
    more = max(2, pool.free_slots() + 1)                                        # more prompts than free slots
    with pytest.raises(ValueError, match=f"at most the {pool.free_slots()} free slots"):
        pool.admit_many(list(range(3, 3 + more)), [[1, 2]] * more)
    out = {k: [] for k in range(3)}
    zeros, k0, p1 = torch.zeros(5), torch.zeros(5, dtype=torch.long), torch.ones(5)
    for _ in range(n):
        tokens = sample_rows(pool.logits, zeros, k0, p1, None)
        for r in rows:
            out[pool.owner[r]].append(int(tokens[r]))
        pool.step(tokens)
    assert [out[k] for k in range(3)] == ref


def test_graphed_prefill_path_equals_generate(tiny):
    """The graphed prefill (``prefill_graphs=True``; on the CPU its static-buffer function runs without a
    capture): prompts padded to the length bucket in a scratch cache of the rows bucket, copied into contiguous or
    scattered free rows; every row then decodes as ``generate`` does for its prompt alone, busy rows untouched,
    and a shape's graph is reused."""
    prompts = [list(b"hi"), list(b"hello there"), list(b"abcdef")]           # 3 prompts: a rows bucket of 4
    equal = [list(range(40, 72)), list(range(100, 132))]                     # 32 tokens: the unpadded graph
    n = 10
    ref = {tuple(p): tiny.generate(torch.tensor([p]), n, tier="T4")[0, len(p):].tolist() for p in prompts + equal}
    for busy in ((), (1, 3)):
        pool = SlotPool(tiny, "T4", 8, max_prefill=4, prefill_graphs=True, graph_after=1)
        for r in busy:
            pool.owner[r] = "other"
        before = [t[list(busy)].clone() for t in pool.cache.tensors()]
        rows = pool.admit_many(list(range(3)), prompts)
        rows += pool.admit_many([3, 4], equal)
        rows.append(pool.admit(5, prompts[1]))                               # one prompt: a graph of one row
        assert len(set(rows)) == 6 and not set(rows) & set(busy)
        assert all(torch.equal(b, t[list(busy)]) for b, t in zip(before, pool.cache.tensors()))
        assert sorted(pool._graphs) == [("T4", 1, 32, True), ("T4", 2, 32, False), ("T4", 4, 32, True)]
        assert greedy_rows(pool, rows, n) == [ref[tuple(p)] for p in prompts + equal + [prompts[1]]], busy
    for r in rows:
        pool.release(r)
    graph = pool._graphs[("T4", 4, 32, True)]
    assert pool.admit_many(["a", "b", "c"], prompts) and pool._graphs[("T4", 4, 32, True)] is graph   # reused


def test_a_prefill_shape_gets_its_graph_the_second_time_it_is_met(tiny):
    """By default a one-off shape is prefilled eagerly (no capture's three forwards for it); the second prompt of
    that shape captures the graph, and both rows decode as ``generate`` does."""
    prompts = [list(b"first prompt"), list(b"other prompt")]                 # 12 tokens: bucket 32
    ref = [tiny.generate(torch.tensor([p]), 8, tier="T4")[0, len(p):].tolist() for p in prompts]
    pool = SlotPool(tiny, "T4", 4, prefill_graphs=True)
    rows = [pool.admit(0, prompts[0])]
    assert not pool._graphs
    rows.append(pool.admit(1, prompts[1]))
    assert list(pool._graphs) == [("T4", 1, 32, True)]
    assert greedy_rows(pool, rows, 8) == ref


def test_a_failed_prefill_capture_turns_the_graphs_off_and_prefills_eagerly(tiny, monkeypatch, caplog):
    import elastic_ssm.serve.slots as slots

    def broken(*a, **k):
        raise ValueError("operation not permitted when stream is capturing")

    monkeypatch.setattr(slots, "PrefillGraph", broken)
    prompt = list(b"hello")
    ref = tiny.generate(torch.tensor([prompt]), 6, tier="T4")[0, len(prompt):].tolist()
    pool = SlotPool(tiny, "T4", 2, prefill_graphs=True, graph_after=1)
    with caplog.at_level("WARNING", logger="elastic_ssm.serve"):
        row = pool.admit("a", prompt)
    assert not pool.prefill_graphs and "capturing a prefill graph failed (ValueError" in caplog.text
    assert greedy_rows(pool, [row], 6) == [ref]


def test_graphed_prefill_bounds_its_graphs_and_goes_eager_above_the_token_limit(tiny):
    """At most ``max_graphs`` graphs (least recently used out); a shape above ``max_graph_tokens`` padded tokens
    is prefilled eagerly and decodes as ``generate`` does."""
    pool = SlotPool(tiny, "T4", 4, max_prefill=2, prefill_graphs=True, max_graphs=2, max_graph_tokens=64,
                    graph_after=1)
    long = list(range(1, 71))                                            # bucket 96 > 64 tokens: eager
    rows = [pool.admit(k, list(range(1, T + 1))) for k, T in enumerate((5, 40))] + [pool.admit(2, long)]
    assert list(pool._graphs) == [("T4", 1, 32, True), ("T4", 1, 64, True)]
    ref = tiny.generate(torch.tensor([long]), 8, tier="T4")[0, len(long):].tolist()
    assert greedy_rows(pool, rows, 8)[2] == ref
    for r in rows:
        pool.release(r)
    pool.admit_many(["a", "b"], [[7] * 20, [9] * 20])                   # 2 rows x 32: evicts (1, 32)
    assert list(pool._graphs) == [("T4", 1, 64, True), ("T4", 2, 32, True)]
    with pytest.raises(ValueError, match="prefill_graphs"):
        SlotPool(tiny, "T4", 2, prefill_graphs="yes")
    for bad in ({"graph_after": 0}, {"max_graphs": 1.5}, {"max_graph_tokens": True}, {"min_span": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int >= 1"):
            SlotPool(tiny, "T4", 2, **bad)
