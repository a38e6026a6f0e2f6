"""``generate`` on CUDA (marker ``gpu``): the pooled, CUDA-graphed fused decoder equals the reference step,
graphs are captured once per (tier, batch bucket) and reused, the compiled model's graphed prefill equals
the eager one, and bad input leaves nothing broken. Run with ``ELASTIC_SSM_SCAN_BACKEND=torch`` to keep
fla's compile out of the prefills (CONTRIBUTING.md)."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.bench.decode import cast_matrices
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import decoder_pool

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = randomize_selective(es.ESSH(es.ESSHConfig.preset("small")).eval(), ffn_out_std=0.1, zero_lag=True)
    return cast_matrices(m.to(DEV), dtype)        # modal tables stay float32, as from_pretrained(dtype=...)


@pytest.fixture(scope="module")
def fp32():
    return _model()


def test_graphed_generate_equals_reference_step_fp32(fp32):
    ids = torch.randint(0, 256, (2, 40), device=DEV)
    for tier in ("T1", "T5", "T10"):
        fast = fp32.generate(ids, 16, tier=tier)                      # default on CUDA: fused + graph
        ref = fp32.generate(ids, 16, tier=tier, fast=False, kv_dtype=torch.bfloat16)
        assert torch.equal(fast, ref), tier
    assert all(row["graphed"] for row in decoder_pool(fp32).info())


@pytest.mark.parametrize("min_span", [16, 1024], ids=["spans", "whole-ring"])
def test_graphed_generate_with_attended_spans_follows_the_forward(fp32, monkeypatch, min_span):
    """Batch 16 (SDPA window step), fp32 ring: the session replays the graph of each step's span (16, 32, 64
    slots of the small preset's 128, then the whole ring; ``whole-ring``: no spans, the baseline) and every
    token is the argmax of the teacher-forced forward's logits up to the row's first near tie (the span's
    shorter SDPA rounds differently from the reference step's, so tokens, not bits, are compared). Prefill and
    reference forward run on the torch scan: fla's float32 products are TF32 (up to 2.8e-3 on the logits of the serve
    tests), more than the 1e-3 near-tie margin, and the scan is not what this test is about."""
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "torch")
    pool = decoder_pool(fp32)
    pool.clear()
    monkeypatch.setattr(pool, "min_span", min_span)
    g = torch.Generator(device=DEV).manual_seed(5)
    ids = torch.randint(0, 256, (16, 10), device=DEV, generator=g)
    fast = fp32.generate(ids, 60, tier="T10", kv_dtype=torch.float32)   # lengths 10 ... 70: 16, 32, 64, all
    fd = pool.get("T10", 16, kv_dtype=torch.float32)
    assert fd.graphed and sorted(fd._span_graphs) == ([16, 32, 64] if min_span == 16 else [])
    want = fp32(fast, tier="T10")[:, 9:-1].float()                     # the logits each new token came from
    top2 = want.topk(2, -1).values
    near_tie = (top2[:, :, 0] - top2[:, :, 1]) < 1e-3
    for r in range(16):
        ties = near_tie[r].nonzero()
        upto = int(ties[0, 0]) if ties.numel() else 60
        got, greedy = fast[r, 10:10 + upto], want[r, :upto].argmax(-1)
        bad = (got != greedy).nonzero()
        assert not bad.numel(), (f"row {r}: first differing new token {int(bad[0, 0])} of {upto} (no near tie "
                                 f"before it)")
    pool.clear()


def test_graphs_are_reused_across_calls(fp32):
    pool = decoder_pool(fp32)
    pool.clear()
    ids = torch.randint(0, 256, (3, 20), device=DEV)
    first = fp32.generate(ids, 8, tier="T4")
    assert pool.captures >= 1
    n, fd = pool.captures, pool.get("T4", 3)
    assert torch.equal(fp32.generate(ids, 8, tier="T4"), first) and pool.captures == n
    fp32.generate(ids[:1], 8, tier="T4")                                # another bucket: one new capture
    fp32.generate(ids, 8, tier="T7")                                    # another tier: one new capture
    assert pool.captures == n + 2 and pool.get("T4", 3) is fd           # the first one is still there


def test_bf16_generate_agrees_with_fp32_forward():
    m = _model(torch.bfloat16, seed=1)
    ref = _model(torch.float32, seed=1)
    ids = torch.randint(0, 256, (4, 64), device=DEV)
    out = m.generate(ids, 32, tier="T10")
    with torch.no_grad():
        want = ref(out, tier="T10")[:, 63:-1].argmax(-1)                # fp32 greedy on the same prefix
    agree = (out[:, 64:] == want).float().mean().item()
    assert agree > 0.9, agree


def test_compiled_model_prefill_graph_equals_eager(fp32):
    compiled = _model()
    es.compile_model(compiled)
    ids = torch.randint(0, 256, (2, 300), device=DEV)                   # padded into the 512 bucket
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    got = compiled.generate(ids, 12, tier="T10", attention_mask=mask)
    want = fp32.generate(ids, 12, tier="T10", attention_mask=mask, fast=False, kv_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    prefills = list(decoder_pool(compiled)._prefills.values())
    assert prefills and all(p.graphed and p.compiled for p in prefills)
    exact = torch.randint(0, 256, (1, 512), device=DEV)                 # a bucket length: unpadded graph
    assert torch.equal(compiled.generate(exact, 6, tier="T10"),
                       fp32.generate(exact, 6, tier="T10", fast=False, kv_dtype=torch.bfloat16))


def test_bad_input_leaves_nothing_broken(fp32):
    pool = decoder_pool(fp32)
    fd = pool.get("T2", 2)
    with pytest.raises(ValueError, match=r"1 <= B <= 2"):
        fd.step(torch.zeros(3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="prompt is empty"):
        fp32.generate(torch.zeros(2, 0, dtype=torch.long, device=DEV), 4, tier="T2")
    ids = torch.randint(0, 256, (2, 10), device=DEV)
    assert torch.equal(fp32.generate(ids, 6, tier="T2"), fp32.generate(ids, 6, tier="T2", fast=False,
                                                                       kv_dtype=torch.bfloat16))


def test_eager_model_prefills_from_a_graph_up_to_graph_tokens(fp32):
    """Not compiled: a padded prompt of at most ``GRAPH_TOKENS`` tokens (2 x 512 here) is prefilled from a CUDA graph
    of the eager trunk and equals the reference; a longer one (2 x 2048) prefills eagerly, also equal."""
    pool = decoder_pool(fp32)
    pool.clear()
    ids = torch.randint(0, 256, (2, 300), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    got = fp32.generate(ids, 12, tier="T10", attention_mask=mask)
    assert torch.equal(got, fp32.generate(ids, 12, tier="T10", attention_mask=mask, fast=False,
                                          kv_dtype=torch.bfloat16))
    prefills = list(pool._prefills.values())
    assert len(prefills) == 1 and prefills[0].graphed and not prefills[0].compiled
    long = torch.randint(0, 256, (2, 2000), device=DEV)
    assert torch.equal(fp32.generate(long, 6, tier="T10"),
                       fp32.generate(long, 6, tier="T10", fast=False, kv_dtype=torch.bfloat16))
    assert len(pool._prefills) == 1                                     # 2 x 2048 > GRAPH_TOKENS: eager


def test_generate_under_inference_mode_then_outside_keeps_its_graphs(fp32):
    """A pool built under ``torch.inference_mode`` (decoder, prefill graph) serves a later ``generate`` outside it:
    same tokens, the prefill still replayed from its graph (no fallback to eager)."""
    pool = decoder_pool(fp32)
    pool.clear()
    ids = torch.randint(0, 256, (1, 200), device=DEV)
    with torch.inference_mode():
        first = fp32.generate(ids, 8, tier="T10")
    again = fp32.generate(ids, 8, tier="T10")
    assert torch.equal(first, again)
    assert pool.eager_graphs and len(pool._prefills) == 1 and next(iter(pool._prefills.values())).graphed
    assert not again.is_inference()
