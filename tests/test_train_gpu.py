"""Training on CUDA in bf16 autocast (ESSH E.5): a few capacity-mixed steps lower the loss, grads stay finite.

Run on a GPU with ``python -m pytest -m gpu tests/test_train_gpu.py``; without CUDA these tests are
strict xfails (tests/conftest.py), never silent skips.
"""

import math

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.train import LossModule, TrainConfig, train

pytestmark = pytest.mark.gpu


def _text_batches(seq_len=128, batch=8):
    tokens = es.data.load_corpus("stdlib", "bytes", split="train", max_bytes=400_000)
    return es.data.PackedBatches(tokens, seq_len, batch, seed=0)


@pytest.mark.parametrize("loss_chunk", [0, 256])
def test_bf16_capacity_mixed_steps_reduce_loss(tmp_path, loss_chunk):
    cfg = TrainConfig(steps=40, micro_batch_size=8, grad_accum=4, seq_len=128, lr=3e-3, warmup_frac=0.1,
                      n_warm_tokens=0, full_share=0.5, order_every=10, precision="bf16", device="cuda",
                      loss_chunk=loss_chunk, eval_every=0, checkpoint_every=0, out_dir=str(tmp_path))
    res = train(es.ESSHConfig.preset("tiny"), _text_batches(), cfg, progress=False)
    losses = [h["loss"] for h in res.history]
    assert all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(h["grad_norm"]) for h in res.history)
    assert any(x != 1.0 for h in res.history for x in h["capacities"])
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert all(p.is_cuda and p.dtype == torch.float32 for p in res.model.parameters())   # fp32 masters

    model = res.model.train()
    ids, labels = (t.cuda() for t in next(iter(_text_batches())))
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16):
        out = LossModule(model)(ids, labels, tier=model.resolve_tier(0.25), ffn_grad_scale=0.5,
                                distill=("kl", 0.5), chunk=loss_chunk)
    out[0].backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_bf16_budget_dropout_es_ssm_on_cuda(tmp_path):
    mcfg = es.ESSSMConfig.preset("tiny", seq_len=128)
    cfg = TrainConfig(steps=30, micro_batch_size=8, grad_accum=2, seq_len=128, lr=3e-3, warmup_frac=0.1,
                      bd_warmup_steps=5, precision="bf16", device="cuda", eval_every=0, checkpoint_every=0,
                      out_dir=str(tmp_path))
    res = train(mcfg, _text_batches(), cfg, progress=False)
    losses = [h["loss"] for h in res.history]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_bf16_training_with_the_torch_scan_at_model_shape(tmp_path, monkeypatch):
    """bf16 autocast with the pure-torch scan (no fla) at the small preset's shape (issue #19): one mode made
    too steep for a factorised block, so the scan takes its mixed plan (Eq. 27 pairwise + factorised)."""
    import importlib

    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    kinds, real = [], ct._plan
    monkeypatch.setattr(ct, "_plan", lambda *a: (lambda p: kinds.append(p[2]) or p)(real(*a)))
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "torch")
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("small"))
    with torch.no_grad():
        model.blocks[0].mixer.rho_raw[-1, -1] = 8.0
    cfg = TrainConfig(steps=30, micro_batch_size=8, grad_accum=2, seq_len=256, lr=3e-3, warmup_frac=0.1,
                      n_warm_tokens=0, full_share=0.5, precision="bf16", device="cuda", eval_every=0,
                      checkpoint_every=0, out_dir=str(tmp_path))
    res = train(model, _text_batches(seq_len=256), cfg, progress=False)
    losses = [h["loss"] for h in res.history]
    assert "mixed" in kinds and all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(h["grad_norm"]) for h in res.history)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses
