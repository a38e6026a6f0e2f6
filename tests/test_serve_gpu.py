"""GPU: a CUDA-graphed slot pool at batch bucket 16 with requests arriving mid-stream equals one-at-a-time
generation (fp32 weights, states and window ring). Run with ``python -m pytest -m gpu tests/test_serve_gpu.py``
(``ELASTIC_SSM_SCAN_BACKEND=torch`` keeps fla from compiling for the prefills)."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.serve.slots import SlotPool
from elastic_ssm.serve.tokens import sample_rows

pytestmark = pytest.mark.gpu


def _pool_run(model, tier, prompts, n, slots, every):
    """Greedy decoding of ``prompts`` through one pool, a new request joining every ``every`` steps; returns per
    request its tokens and the logits it was sampled from."""
    pool = SlotPool(model, tier, slots, kv_dtype=torch.float32)
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
    return toks, logits


@pytest.mark.parametrize("tier", ["T2", "T10"])
def test_pool_at_bucket_16_with_mid_stream_arrivals_equals_one_at_a_time(tier):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = es.ESSHConfig.preset("tiny", tie_embeddings=False)
    model = randomize_selective(es.ESSH(cfg), 0.5, True).cuda().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(L),), generator=g).tolist()
               for L in torch.randint(1, 40, (24,), generator=g)]          # 24 requests through 16 slots
    n = 32
    toks, logits = _pool_run(model, tier, prompts, n, slots=16, every=3)
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
