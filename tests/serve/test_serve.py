"""Serving pieces without HTTP: per-row sampling, text, select_tier and calibration, the engine (queue, stalled
clients, failures, bursts) and the guard. The slot pool and prefill: ``test_serve_slots.py``."""

import asyncio
import json
import time

import pytest
import torch
from served import run_to_completion

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.elastic.tiers import state_bytes
from elastic_ssm.models.generation import sample_next
from elastic_ssm.serve.engine import Busy, Engine, Request
from elastic_ssm.serve.schema import resolve_model_field
from elastic_ssm.serve.select import calibrate, quality_table, write_profile, write_quality
from elastic_ssm.serve.tokens import RowNoise, TextStream, sample_rows


def test_sample_rows_equals_sample_next_row_by_row():
    torch.manual_seed(1)
    logits = torch.randn(5, 50) * 3
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9])
    top_k = torch.tensor([0, 5, 0, 3, 10])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 0.5])
    noise = RowNoise(5, 50, torch.device("cpu"))
    for row in range(5):
        noise.seed_row(row, 100 + row)
    for call in range(3):
        got = sample_rows(logits, temp, top_k, top_p, noise.draw())
        for row in range(5):
            g = torch.Generator().manual_seed(100 + row)
            for _ in range(call + 1):   # the row's generator has drawn once per call so far
                want = sample_next(logits[row:row + 1], float(temp[row]), int(top_k[row]) or None,
                                   float(top_p[row]), generator=g)
            if float(temp[row]) == 0:
                assert int(got[row]) == int(logits[row].argmax())
            else:
                assert int(got[row]) == int(want[0]), row


def test_text_stream_decodes_split_characters_and_cuts_at_stop():
    tok = data.load_tokenizer("bytes")
    s = TextStream(tok, ["END"])
    pieces = [s.push(b) for b in "é ok EN".encode()]
    assert "".join(pieces) == "é ok "               # "EN" held back: it could begin "END"
    assert s.push(ord("D")) == "" and s.stopped and s.text == "é ok "
    go_on = TextStream(tok, ["END"])
    assert "".join(go_on.push(b) for b in b"ENx!") == "EN" and not go_on.stopped and go_on.flush() == "x!"
    plain = TextStream(tok, [])
    assert [plain.push(b) for b in "é".encode()] == ["", "é"]
    assert plain.push(258) == "" and plain.flush() == ""


def test_text_stream_of_a_subword_model_ends_an_incomplete_character_as_decode_does(tmp_path):
    """A BPE model's tokens held back as an incomplete character were dropped at the end (max_tokens cutting an
    emoji or a CJK character in two lost it, and the text of a token ending in a lead byte with it)."""
    tok = data.train_bpe(["plain ascii text, nothing else here. " * 20], 300, tmp_path / "tokenizer.json")
    ids = tok.encode("ok \u20ac")[:-1]                  # the euro sign's last byte cut off
    for stop in ([], ["zz"]):
        s = TextStream(tok, stop)
        assert "".join(s.push(t) for t in ids) + s.finish() == tok.decode(ids) == "ok \ufffd"


def test_engine_queue_is_bounded(tiny):
    eng = Engine(tiny, ["T1"], slots=1, max_queue=1, tokenizer=tiny.tokenizer)   # not started: nothing runs
    eng.submit(Request(tier="T1", prompt=[1], max_tokens=1))
    eng.submit(Request(tier="T1", prompt=[1], max_tokens=1))
    with pytest.raises(Busy, match="at capacity"):
        eng.submit(Request(tier="T1", prompt=[1], max_tokens=1))


def test_select_tier_against_the_exact_counts(tiny, tmp_path):
    cfg, table = tiny.config, tiny.tier_table()
    tiny.save_pretrained(tmp_path)
    assert es.select_tier(tmp_path) == table[-1]
    assert es.select_tier(tmp_path, max_params=table[3].params) == table[3]
    assert es.select_tier(tiny, max_params=table[3].params - 1) == table[2]
    sb = [state_bytes(cfg, t, 4)["total"] for t in table]
    for limit in (sb[5], sb[5] - 1, sb[-1]):   # tiers of equal K hold equal state: the largest of them wins
        want = max((t for t, b in zip(table, sb) if b <= limit), key=lambda t: t.index)
        assert es.select_tier(tmp_path, max_state_bytes=limit, batch=4) == want
    with pytest.raises(ValueError, match=r"no tier fits the budget; the closest is T1 \(params"):
        es.select_tier(tmp_path, max_params=table[0].params - 1)
    with pytest.raises(ValueError, match="needs a measured profile: run `elastic-ssm calibrate"):
        es.select_tier(tmp_path, max_ms_per_token=1.0)


def test_select_tier_with_a_synthetic_profile_and_quality(tiny, tmp_path):
    table = tiny.tier_table()
    ms = {t.name: {"ms_per_token": {"1": 0.1 * t.index, "16": 0.2 * t.index}} for t in table}
    profile = {"device": "synthetic", "tiers": ms}
    assert es.select_tier(tiny, max_ms_per_token=0.45, profile=profile) == table[3]
    assert es.select_tier(tiny, max_ms_per_token=0.45, batch=16, profile=profile) == table[1]
    assert es.select_tier(tiny, max_ms_per_token=0.45, batch=8, profile=profile) == table[1]  # next profiled: 16
    with pytest.raises(ValueError, match="not profiled at batch >= 32"):
        es.select_tier(tiny, max_ms_per_token=10.0, batch=32, profile=profile)
    # measured quality overrides the tier order: here T7 scores best (lower bpb) among those that fit
    quality = {"metric": "bpb", "higher_is_better": False,
               "tiers": {t.name: {"value": 2.0 - (0.1 if t.name == "T7" else 0.01 * t.index)} for t in table}}
    assert es.select_tier(tiny, max_params=table[8].params, quality=quality) == table[6]
    tiny.save_pretrained(tmp_path)
    write_profile(tmp_path, profile)
    write_quality(tmp_path, quality | {"data": "d", "split": "s"})
    assert es.select_tier(str(tmp_path), max_ms_per_token=0.75) == table[6]


def test_calibrate_and_quality_files(tiny, tmp_path):
    prof = calibrate(tiny, [1, 2], ["T1", "T10"], warmup=1, iters=2, progress=lambda *a, **k: None)
    assert set(prof["tiers"]) == {"T1", "T10"} and prof["tiers"]["T1"]["params"] == tiny.num_parameters("T1")
    assert prof["tiers"]["T10"]["state_bytes"] == state_bytes(tiny.config, "T10")["total"]
    assert all(v > 0 for r in prof["tiers"].values() for v in r["ms_per_token"].values())
    tiny.save_pretrained(tmp_path)
    write_profile(tmp_path, prof)
    assert json.loads((tmp_path / "tier_profile.json").read_text())["device"] == prof["device"]
    slow = max(prof["tiers"]["T10"]["ms_per_token"]["1"], prof["tiers"]["T1"]["ms_per_token"]["1"])
    assert es.select_tier(tmp_path, max_ms_per_token=slow * 2).name in ("T1", "T10")
    from elastic_ssm.eval.perplexity import TierEval

    rows = [TierEval("T1", 1, 16, 10, 2.0, 100, 1.0), TierEval("T2", 2, 32, 20, 1.5, 100, 1.0)]
    q = quality_table(rows, "stdlib", "validation")
    assert q["tiers"]["T2"]["value"] == pytest.approx(1.5 / 0.6931471805599453) and not q["higher_is_better"]


def test_a_stalled_client_is_cancelled_and_its_slot_freed(tiny):
    eng = Engine(tiny, ["T1"], slots=2, stall_timeout=0.3, tokenizer=tiny.tokenizer).start()
    try:
        stalled = Request(tier="T1", prompt=[1, 2], max_tokens=100000)   # nobody ever takes its events
        eng.submit(stalled)
        deadline = time.time() + 20
        while stalled.finish_reason is None and time.time() < deadline:
            time.sleep(0.05)
        assert stalled.finish_reason == "cancelled" and stalled.completion_tokens < 100000
        assert eng.pool.busy() == 0
    finally:
        eng.shutdown()
    # a reading client is never dropped, and time spent waiting for a slot does not count as not reading
    eng = Engine(tiny, ["T1"], slots=1, stall_timeout=1.0, tokenizer=tiny.tokenizer).start()
    try:
        first = Request(tier="T1", prompt=[1], max_tokens=100000)
        queued = Request(tier="T1", prompt=[2], max_tokens=5)
        eng.submit(first)
        eng.submit(queued)
        t0 = time.time()
        while queued.finish_reason is None and time.time() - t0 < 20:
            for r in (first, queued):                     # a client reading every 0.3 s
                while r.pending > 0:
                    r.took()
            if time.time() - t0 > 2.0:
                first.cancel()                            # the client of the first request leaves
            time.sleep(0.3)
        assert first.finish_reason == "cancelled" and first.completion_tokens > 1
        assert queued.finish_reason == "length" and queued.completion_tokens == 5
    finally:
        eng.shutdown()


def test_every_tier_shares_one_pool_and_auto_keeps_the_default_tier(tiny):
    """One pool of ``slots`` rows for all tiers: the queue bound counts every tier's requests together, and "auto"
    stays at the default tier (a smaller tier frees no capacity in a shared decode step)."""
    eng = Engine(tiny, ["T1", "T4", "T10"], slots=1, max_queue=2, tokenizer=tiny.tokenizer)   # not started: wait
    assert eng.pool.tiers == [tiny.resolve_tier(t) for t in ("T1", "T4", "T10")] and eng.pool.fd.mixed
    for tier in ("T10", "T4", "T1"):                    # 1 free slot + max_queue 2: three may wait
        eng.submit(Request(tier=tier, prompt=[1], max_tokens=1))
    with pytest.raises(Busy, match="at capacity"):
        eng.submit(Request(tier="T1", prompt=[1], max_tokens=1))
    assert eng.snapshot() == {t: {"slots": 1, "busy": 0, "waiting": 1} for t in ("T1", "T4", "T10")}
    assert eng.pool.free_slots() == 1 and len(eng.waiting) == 3
    for model, tier in (("m@auto", None), ("m", "auto"), ("m@AUTO", "auto")):    # "auto": the default tier
        assert resolve_model_field(model, tier, "m", ["T1", "T4", "T10"], "T4") == "T4"
    with pytest.raises(ValueError, match="not served here"):
        eng.submit(Request(tier="T2", prompt=[1], max_tokens=1))


def test_guard_caps_connections_per_client():
    from elastic_ssm.serve.guard import Guard

    gate = asyncio.Event()
    sent = []

    async def app(scope, receive, send):
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def run():
        guard = Guard(app, api_key=None, max_connections=2, max_body=100)
        scope = {"type": "http", "path": "/v1/models", "headers": [], "client": ("10.0.0.1", 1)}

        async def send(msg):
            sent.append(msg.get("status"))

        tasks = [asyncio.create_task(guard(scope, None, send)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert [s for s in sent if s] == [429]          # the third concurrent request from one address
        other = dict(scope, client=("10.0.0.2", 1))
        gate.set()
        await asyncio.gather(*tasks, guard(other, None, send))
        assert sorted(s for s in sent if s) == [200, 200, 200, 429]
        assert guard._open == {}

    asyncio.run(run())


def test_calibrate_command_writes_the_profile_select_tier_reads(tiny, tmp_path, capsys):
    from elastic_ssm.cli import main

    tiny.save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--tier", "auto", "--max_ms_per_token", "5", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "needs a measured profile: run `elastic-ssm calibrate" in err and len(err.strip().splitlines()) == 1
    assert main(["calibrate", str(tmp_path), "--batches", "1,2", "--tiers", "T1,T10", "--warmup", "1",
                 "--iters", "2"]) == 0
    prof = json.loads((tmp_path / "tier_profile.json").read_text())
    assert set(prof["tiers"]) == {"T1", "T10"} and set(prof["tiers"]["T1"]["ms_per_token"]) == {"1", "2"}
    assert main(["calibrate", str(tmp_path), "--batches", "0"]) == 2
    assert "--batches must be integers >= 1" in capsys.readouterr().err
    essm = es.ESSSM(es.ESSSMConfig.preset("tiny"))
    essm.save_pretrained(tmp_path / "essm")
    assert main(["calibrate", str(tmp_path / "essm")]) == 2
    err = capsys.readouterr().err       # one line that says what ES-SSM offers instead
    assert "arch 'es_ssm'; `elastic-ssm calibrate` runs ESSH models only" in err and "elastic-ssm generate" in err
    assert len(err.strip().splitlines()) == 1
    # no profile can exist for ES-SSM: --tier auto's latency budget points at the budgets that work, not calibrate
    assert main(["generate", str(tmp_path / "essm"), "--tier", "auto", "--max_ms_per_token", "5", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--max_params or --max_state_bytes" in err and "run `elastic-ssm calibrate" not in err
    assert main(["generate", str(tmp_path / "essm"), "--tier", "auto", "--max_params", "1000000000", "--prompt", "x",
                 "--max_new_tokens", "1"]) == 0
    # only T1 and T10 were profiled: a latency budget considers those
    assert es.select_tier(tmp_path, max_ms_per_token=1e6).name == "T10"


def test_a_failing_request_or_step_ends_alone_and_the_engine_keeps_serving(tiny):
    eng = Engine(tiny, ["T1"], slots=2, tokenizer=tiny.tokenizer).start()
    pool = eng.pool
    admit, step = pool.admit, pool.step

    def bad_admit(owner, prompt, tier=None):
        if prompt == [9]:
            raise ValueError("boom")
        return admit(owner, prompt, tier)

    pool.admit = bad_admit
    pool.admit_many = lambda owners, prompts, tier=None: (_ for _ in ()).throw(RuntimeError("batched prefill failed"))

    def wait(*reqs):
        deadline = time.time() + 20
        while any(r.finish_reason is None for r in reqs) and time.time() < deadline:
            time.sleep(0.02)

    try:
        bad, good = Request(tier="T1", prompt=[9], max_tokens=4), Request(tier="T1", prompt=[8], max_tokens=4)
        eng.submit(bad)
        eng.submit(good)
        wait(bad, good)
        assert (bad.finish_reason, good.finish_reason) == ("error", "length") and good.completion_tokens == 4
        pool.step = lambda tokens: (_ for _ in ()).throw(RuntimeError("kernel failure"))
        hit = Request(tier="T1", prompt=[8], max_tokens=4)
        eng.submit(hit)
        wait(hit)
        assert hit.finish_reason == "error" and pool.busy() == 0 and eng.alive()
        pool.step = step
        after = Request(tier="T1", prompt=[8], max_tokens=4)
        eng.submit(after)
        wait(after)
        assert after.finish_reason == "length"
    finally:
        eng.shutdown()


def test_engine_prefills_a_burst_in_groups_of_max_prefill_and_matches_generate(tiny):
    prompts = [list(b"burst-%02d" % i) for i in range(7)]            # seven prompts of one length
    n = 6
    ref = [tiny.generate(torch.tensor([p]), n, tier="T4")[0, len(p):].tolist() for p in prompts]
    eng = Engine(tiny, ["T4"], slots=8, tokenizer=tiny.tokenizer, max_prefill=3)
    pool = eng.pool
    assert pool.max_prefill == 3
    groups, admit_many = [], pool.admit_many
    pool.admit_many = lambda owners, ps, tier=None: groups.append(len(ps)) or admit_many(owners, ps, tier)
    reqs = [Request(tier="T4", prompt=p, max_tokens=n, temperature=0.0) for p in prompts]
    run_to_completion(eng, reqs, timeout=30)     # all queued before the loop starts: one admission round
    assert groups == [3, 3]             # and the seventh alone (SlotPool.admit)
    assert [r.tokens for r in reqs] == ref and {r.finish_reason for r in reqs} == {"length"}
    with pytest.raises(ValueError, match="max_prefill"):
        Engine(tiny, ["T4"], slots=2, max_prefill=0)
    with pytest.raises(ValueError, match="max_prefill_tokens must be an int >= 1"):
        Engine(tiny, ["T4"], slots=2, max_prefill_tokens=0)


def test_serve_names_the_http_stack_it_runs_on(monkeypatch):
    """``serve``'s start line says whether uvicorn runs on uvloop and httptools (the ``serve`` extra) or falls back
    to asyncio and h11, and how to get the fast pair."""
    import importlib.util

    from elastic_ssm.serve.cli import http_stack

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object() if n in ("uvloop", "httptools") else real(n))
    assert http_stack() == "event loop uvloop, HTTP httptools"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n in ("uvloop", "httptools") else real(n))
    stack = http_stack()
    assert "asyncio" in stack and "pip install uvloop" in stack and "h11" in stack and "pip install httptools" in stack


def test_guard_caps_requests_from_all_clients_in_the_api_error_shape():
    """``--max_connections N`` admits N requests in flight from all addresses and refuses the next with a JSON
    503 and Retry-After (uvicorn's own cap, given N, refused in plain text and let only N - 1 through)."""
    from elastic_ssm.serve.guard import Guard, uvicorn_connection_limit

    gate, sent = asyncio.Event(), []

    async def app(scope, receive, send):
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def run():
        guard = Guard(app, api_key=None, max_connections=8, max_body=100, max_requests=3)

        async def send(msg):
            sent.append(msg)

        scopes = [{"type": "http", "path": "/v1/models", "headers": [], "client": (f"10.0.0.{i}", 1)}
                  for i in range(4)]
        tasks = [asyncio.create_task(guard(s, None, send)) for s in scopes]
        await asyncio.sleep(0.05)
        [start] = [m for m in sent if m.get("type") == "http.response.start"]
        assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
        body = json.loads([m for m in sent if m.get("type") == "http.response.body"][0]["body"])
        assert "3 requests in flight" in body["error"]["message"] and "--max-connections" in body["error"]["message"]
        gate.set()
        await asyncio.gather(*tasks, guard(scopes[0], None, send))      # the cap frees as requests end
        assert sorted(m["status"] for m in sent if "status" in m) == [200, 200, 200, 200, 503]
        assert guard._in_flight == 0

    asyncio.run(run())
    assert uvicorn_connection_limit(3) > 3
