"""GPU: a CUDA-graphed slot pool at batch bucket 16 with requests arriving mid-stream equals one-at-a-time
generation (fp32 weights, states and window ring), also for prompts of different lengths prefilled together;
the engine over two graphed tiers repeats seeded
sampled requests exactly; calibration times graphed pools. Run with
``python -m pytest -m gpu tests/serve/test_serve_gpu.py``.

The fp32 checks hold every logit to 1e-3 of the teacher-forced forward, which the torch scan meets; fla's float32
products run in TF32 (a 2.8e-3 absolute difference on an H200, twelfth session), so the module runs the prefills
on the torch scan (``torch_scan``) and the prompts-prefilled-together test runs once more on fla (the default on
CUDA, what ``serve`` uses) with a TF32 tolerance."""

import time

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.serve.engine import Engine, Request
from elastic_ssm.serve.select import calibrate
from elastic_ssm.serve.slots import SlotPool
from elastic_ssm.serve.tokens import sample_rows

pytestmark = pytest.mark.gpu
TOL = {"torch": 1e-3, "fla": 1e-2}      # fla: TF32 products, 2.8e-3 measured (eager prefill, no busy rows)


@pytest.fixture(autouse=True)
def torch_scan(monkeypatch):
    """Prefills on the torch scan unless a test asks for another (``monkeypatch.setenv`` inside the test)."""
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "torch")


def _pool_run(model, tier, prompts, n, slots, every, prefill_graphs=None, min_span=128, spans=None):
    """Greedy decoding of ``prompts`` through one pool, a new request joining every ``every`` steps; returns per
    request its tokens and the logits it was sampled from (``spans``: a list that collects each step's span)."""
    pool = SlotPool(model, tier, slots, kv_dtype=torch.float32, prefill_graphs=prefill_graphs, min_span=min_span,
                    graph_after=1)
    if spans is not None:
        fd_step = pool.fd.step
        pool.fd.step = lambda tokens, span=None: spans.append(pool.fd.span_for(span)) or fd_step(tokens, span=span)
    assert pool.graphed
    dev = pool.device
    zeros, k0, p1 = torch.zeros(slots, device=dev), torch.zeros(slots, dtype=torch.long, device=dev), \
        torch.ones(slots, device=dev)
    toks, logits = {}, {}
    waiting, step = list(enumerate(prompts)), 0
    while waiting or pool.busy():
        if waiting and step % every == 0:
            k, p = waiting.pop(0)
            pool.admit(k, p)
            toks[k], logits[k] = [], []
        nxt = sample_rows(pool.logits, zeros, k0, p1, None)
        for r in pool.active_rows():
            k = pool.owner[r]
            toks[k].append(int(nxt[r]))
            logits[k].append(pool.logits[r].clone())
            if len(toks[k]) == n:
                pool.release(r)
        pool.step(nxt)
        step += 1
    assert pool.prefill_graphs == (prefill_graphs is not False) and (pool.captures > 0) == pool.prefill_graphs
    return toks, logits


@pytest.mark.parametrize("graphs", [None, False], ids=["graphed-prefill", "eager-prefill"])
@pytest.mark.parametrize("tier", ["T2", "T10"])
def test_pool_at_bucket_16_with_mid_stream_arrivals_equals_one_at_a_time(tier, graphs):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = es.ESSHConfig.preset("tiny", tie_embeddings=False)
    model = randomize_selective(es.ESSH(cfg), 0.5, True).cuda().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(L),), generator=g).tolist()
               for L in torch.randint(1, 40, (24,), generator=g)]          # 24 requests through 16 slots
    n = 32
    toks, logits = _pool_run(model, tier, prompts, n, slots=16, every=3, prefill_graphs=graphs)
    for k, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p], device="cuda"), n, tier=tier, kv_dtype=torch.float32)[0, len(p):]
        # teacher-forced reference logits of the pool's own tokens: every step of the pool matches them
        full = torch.tensor([p + toks[k]], device="cuda")
        want = model(full, tier=tier)[0, len(p) - 1:-1].float()                       # [n, V]
        got = torch.stack(logits[k])
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        # and the tokens equal one-at-a-time generate up to the first near tie of the reference
        top2 = want.topk(2, -1).values
        ties = ((top2[:, 0] - top2[:, 1]) < 1e-3).nonzero()
        upto = int(ties[0, 0]) if ties.numel() else n
        assert toks[k][:upto] == ref[:upto].tolist(), k


@pytest.mark.parametrize("slots", [8, 16])          # the Triton window kernels up to batch 8, SDPA above
def test_graphed_attended_spans_equal_the_teacher_forced_forward(slots):
    """Short prompts (1-3 tokens) on the tiny model (window 16) with spans of 4 and 8: the pool replays the graph
    of each step's span (4, 8, then the whole ring) and every row's logits equal the teacher-forced forward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.5, True).cuda().eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(L),), generator=g).tolist() for L in torch.randint(1, 4, (10,), generator=g)]
    spans: list = []
    toks, logits = _pool_run(model, "T10", prompts, 14, slots=slots, every=3, min_span=4, spans=spans)
    assert set(spans) == {4, 8, None}
    for k, p in enumerate(prompts):
        want = model(torch.tensor([p + toks[k]], device="cuda"), tier="T10")[0, len(p) - 1:-1].float()
        torch.testing.assert_close(torch.stack(logits[k]), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scan", ["torch", "fla"])
@pytest.mark.parametrize("graphs", [None, False], ids=["graphed-prefill", "eager-prefill"])
@pytest.mark.parametrize("busy", [(), (1, 4, 6)])
def test_prompts_of_different_lengths_prefilled_together_on_cuda(busy, graphs, scan, monkeypatch):
    """``admit_many`` on CUDA (graphed pool, fp32): prompts of 3-37 tokens left-padded into one forward, into
    consecutive rows or (some rows busy) through the scratch cache, replayed from a prefill graph (6 prompts: 8
    rows x 64 tokens, the unused rows and the padding never read) or eagerly; every row then decodes with the
    logits of its own prompt (teacher-forced reference), i.e. the padding never reached a state. On the torch
    scan and on fla (the default on CUDA; fla-core must be installed: an ImportError otherwise, not a skip)."""
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", scan)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.5, True).cuda().eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (3, 17, 9, 37, 30, 12)]
    pool = SlotPool(model, "T10", 16, kv_dtype=torch.float32, prefill_graphs=graphs, graph_after=1)
    for r in busy:
        pool.owner[r] = "busy"
    rows = pool.admit_many(list(range(len(prompts))), prompts)
    assert not set(rows) & set(busy)
    assert list(pool._graphs) == ([("T10", 8, 64, True)] if graphs is None else [])
    assert pool.captures == len(pool._graphs)
    n, logits = 12, {r: [] for r in rows}
    zeros, k0, p1 = torch.zeros(16, device="cuda"), torch.zeros(16, dtype=torch.long, device="cuda"), \
        torch.ones(16, device="cuda")
    toks = {r: [] for r in rows}
    for _ in range(n):
        nxt = sample_rows(pool.logits, zeros, k0, p1, None)
        for r in rows:
            logits[r].append(pool.logits[r].clone())
            toks[r].append(int(nxt[r]))
        pool.step(nxt)
    for r, p in zip(rows, prompts):
        want = model(torch.tensor([p + toks[r]], device="cuda"), tier="T10")[0, len(p) - 1:-1].float()
        torch.testing.assert_close(torch.stack(logits[r]), want, rtol=TOL[scan], atol=TOL[scan])


def _wait(reqs, seconds=120):
    deadline = time.time() + seconds
    while any(r.finish_reason is None for r in reqs) and time.time() < deadline:
        time.sleep(0.01)


def test_engine_on_cuda_serves_two_graphed_tiers_and_seeded_requests_repeat():
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.5, True)
    model = model.cuda().eval()
    model.tokenizer = data.load_tokenizer("bytes")
    eng = Engine(model, ["T1", "T10"], slots=16, tokenizer=model.tokenizer).start()
    try:
        assert eng.pool.graphed

        def batch():
            reqs = [Request(tier=t, prompt=list(b"seeded prompt %d" % i), max_tokens=24, temperature=0.9,
                            top_p=0.95, top_k=50, seed=i) for i in range(20) for t in ("T1", "T10")]
            for r in reqs:
                eng.submit(r)
            _wait(reqs)
            return reqs

        first, again = batch(), batch()
        assert all(r.finish_reason == "length" and r.completion_tokens == 24 for r in first + again)
        assert [r.tokens for r in first] == [r.tokens for r in again]
        assert len({tuple(r.tokens) for r in first}) > 1            # sampled, not one fixed answer
    finally:
        eng.shutdown()


def test_calibrate_on_cuda_times_graphed_pools():
    model = es.ESSH(es.ESSHConfig.preset("tiny")).cuda().eval()
    prof = calibrate(model, [1, 16], ["T1", "T10"], warmup=2, iters=5, progress=lambda *a, **k: None)
    assert prof["device"] == torch.cuda.get_device_name(0)
    assert all(v > 0 for row in prof["tiers"].values() for v in row["ms_per_token"].values())
    assert es.select_tier(model, max_ms_per_token=1e3, profile=prof).name == "T10"


def test_step_async_hands_back_the_sampled_tokens_and_steps_like_step():
    """The engine's overlapped step: the host gets exactly the sampled tokens, and the next logits equal those
    of the synchronous ``step`` (graphed pools, fp32)."""
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.5, True).cuda().eval()
    pools = [SlotPool(model, "T10", 8, kv_dtype=torch.float32) for _ in range(2)]
    for pool in pools:
        for k in range(5):
            pool.admit(k, list(range(3 + k, 20 + 2 * k)))
    dev = pools[0].device
    temp, k0, p1 = torch.full((8,), 0.9, device=dev), torch.zeros(8, dtype=torch.long, device=dev), \
        torch.ones(8, device=dev)
    for _ in range(12):
        torch.testing.assert_close(pools[0].logits, pools[1].logits, rtol=0, atol=0)
        tokens = sample_rows(pools[0].logits, temp, k0, p1, torch.empty(8, model.config.vocab_size,
                                                                       device=dev).exponential_())
        assert pools[0].step_async(tokens) == tokens.tolist()
        pools[1].step(tokens)
