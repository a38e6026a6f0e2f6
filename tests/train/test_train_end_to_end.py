"""Training runs end to end: shared refinement (D.8), budget dropout (ES-SSM Sec. 4.2), bit-exact resume,
corrupted checkpoints, DDP on gloo, a compiled model, CUDA-graph steps' gradients and bf16 autocast. The units
(config, schedule, groups, capacity-mixed step, losses, FFN ordering): ``test_train.py``."""

import importlib
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import finish_rank
from test_train import B, L, _cfg, _micro_batches, _tiny, _tokens

import elastic_ssm as es
from elastic_ssm.config import ConfigError
from elastic_ssm.train import (
    RefineConfig,
    SharedRefinement,
    TrainConfig,
    find_checkpoint,
    train,
)


# ---- recipes end to end ------------------------------------------------------------------------------
def test_shared_refinement_stage(tiny_cfg, tmp_path):
    rec = SharedRefinement(tiny_cfg, TrainConfig(refine=dict(capacities=(0.25, 0.5), capacity_mode="cycle")))
    labels = [p.label for p in rec.global_plan(0, 0, 4)]
    assert sorted(labels) == [0.25, 0.25, 0.5, 0.5] and labels[0] != labels[1]
    cfg = _cfg(tmp_path, steps=1, mixing=dict(full_share=0.5), refine=RefineConfig(steps=2))
    res = train(_tiny(tiny_cfg), es.data.PackedBatches(_tokens(), L, B), cfg, progress=False)
    r = [h for h in res.history if h["stage"] == "refine"]
    assert len(r) == 2 and len(set(r[0]["capacities"])) == 1
    assert r[0]["loss"] == pytest.approx(r[0]["ce_full"] + r[0]["ce"] + 5 * r[0]["aux"], rel=1e-6)
    assert r[0]["lr"] == pytest.approx(6e-5) and (tmp_path / "refine" / "step_0000002").is_dir()


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_budget_dropout_recipe_es_ssm(tmp_path, task):
    mcfg = es.ESSSMConfig.preset("tiny", seq_len=L, task=task, num_classes=3 if task == "classify" else 0)
    if task == "lm":
        data = es.data.PackedBatches(_tokens(), L, B)
    else:
        g = torch.Generator().manual_seed(0)
        data = [(torch.randint(0, 256, (B, L), generator=g), torch.randint(0, 3, (B,), generator=g))
                for _ in range(12)]
    cfg = _cfg(tmp_path, steps=6, budget_dropout=dict(warmup_steps=2, n_full=3))
    res = train(mcfg, data, cfg, val_data=data, progress=False)
    sampler = es.BudgetSampler(mcfg.budgets, mcfg.n_channels, warmup_steps=2, n_full=3, seed=0)
    assert [h["capacities"] for h in res.history] == [[sampler.sample(s)] * 2 for s in range(6)]
    assert all(math.isfinite(h["loss"]) for h in res.history)
    assert {e["tier"] for e in res.evals} == {"K2", "K4", "K8"}
    assert ("accuracy" if task == "classify" else "bpb") in res.evals[0]


# ---- checkpoints ---------------------------------------------------------------------------------------
def test_resume_is_bit_exact(tiny_cfg, tmp_path):
    kw = dict(steps=6, mixing=dict(n_warm_tokens=2 * B * L * 2, full_share=0.5), ordering=dict(every=2))
    straight = train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B), _cfg(tmp_path / "a", **kw),
                     progress=False)
    first = train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B), _cfg(tmp_path / "b", **kw),
                  progress=False, stop_after=3)
    assert first.model_path is None
    rest = train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B), _cfg(tmp_path / "b", **kw),
                 progress=False, resume=True)
    assert [h["loss"] for h in straight.history] == [h["loss"] for h in first.history + rest.history]
    assert any(x != 1.0 for h in straight.history for x in h["capacities"])
    assert any(h.get("ffn_ordered") for h in straight.history)
    a, b = straight.model.state_dict(), rest.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for f, g in zip(straight.model.ffn_layers(), rest.model.ffn_layers()):
        assert torch.equal(f.act_sq, g.act_sq)


def test_corrupted_checkpoint_is_skipped(tiny_cfg, tmp_path):
    cfg = _cfg(tmp_path, steps=4, checkpoint=dict(every=2, keep_last=2), mixing=dict(full_share=0.5))
    train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B), cfg, progress=False)
    stage = tmp_path / "pretrain"
    assert sorted(p.name for p in stage.glob("step_*")) == ["step_0000002", "step_0000004"]
    assert find_checkpoint(stage).name == "step_0000004"
    with open(stage / "step_0000004" / "optimizer.pt", "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning, match="incomplete"):
        assert find_checkpoint(stage).name == "step_0000002"
    res = train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B), cfg, progress=False, resume=True)
    assert [h["step"] for h in res.history] == [3, 4]
    assert len(list((tmp_path / "damaged" / "pretrain").glob("step_0000004.damaged-*"))) == 1  # moved, not deleted


# ---- DDP on gloo -----------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, out_dir, result_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)   # ours: train() then leaves it standing
    try:
        cfg = _cfg(out_dir, steps=3, grad_accum=1, mixing=dict(full_share=0.5))
        data = lambda r, w: es.data.PackedBatches(_tokens(), L, B, rank=r, world_size=w)  # noqa: E731
        res = train(es.ESSHConfig.preset("tiny"), data, cfg, progress=False)
        if rank == 0:
            torch.save({"loss": [h["loss"] for h in res.history], "caps": [h["capacities"] for h in res.history],
                        "state": res.model.state_dict()}, result_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    # a barrier, then exit without gloo's teardown (tests/gloo_ranks.py): once in three CI runs on 2026-12-01 rank
    # 1 of this test aborted there ("terminate called without an active exception") after a complete run
    finish_rank()


def test_ddp_gloo_matches_single_process(tiny_cfg, tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path / "ddp"), str(tmp_path / "ddp.pt")), nprocs=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    single = train(tiny_cfg, es.data.PackedBatches(_tokens(), L, B),
                   _cfg(tmp_path / "one", steps=3, grad_accum=2, mixing=dict(full_share=0.5)), progress=False)
    assert ddp["caps"] == [h["capacities"] for h in single.history]
    assert any(x != 1.0 for c in ddp["caps"] for x in c)
    for a, b in zip(ddp["loss"], [h["loss"] for h in single.history]):
        assert a == pytest.approx(b, abs=1e-6)
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(ddp["state"][k], v, rtol=1e-4, atol=1e-6)


def test_compile_scope_model_trains_like_eager(tiny_cfg, tmp_path, monkeypatch):
    """``compile=True, compile_scope='model'`` goes through ``compile_model`` (here with the ``aot_eager``
    backend: the whole forward/backward graph without inductor's C++ compile) and trains like eager."""
    import elastic_ssm.models as models

    seen = []
    real = models.compile_model
    monkeypatch.setattr(models, "compile_model",
                        lambda m, **kw: seen.append(m) or real(m, backend="aot_eager", fullgraph=True, **kw))
    kw = dict(steps=2, grad_accum=1, recipe="dense")
    eager = train(tiny_cfg, _micro_batches(2), _cfg(tmp_path / "e", **kw), progress=False)
    comp = train(tiny_cfg, _micro_batches(2), _cfg(tmp_path / "c", compile=True, compile_scope="model", **kw),
                 progress=False)
    assert len(seen) == 1 and "_compiled_trunk" in vars(seen[0])
    for a, b in zip(eager.history, comp.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="compile_scope"):
        TrainConfig(compile_scope="layers")
    with pytest.raises(ConfigError, match="fsdp"):
        TrainConfig(compile=True, compile_scope="model", parallel="fsdp")
    with pytest.raises(ConfigError, match="compile_mode: 'reduce-overhead' takes effect only with compile"):
        TrainConfig(compile_mode="reduce-overhead")
    modes = []                          # compile_mode reaches torch.compile (MQAR's launch-bound step)
    monkeypatch.setattr(models, "compile_model", lambda m, **kw: modes.append(kw) or m)
    train(tiny_cfg, _micro_batches(1), _cfg(tmp_path / "m", compile=True, compile_scope="model",
                                            compile_mode="reduce-overhead", **{**kw, "steps": 1}), progress=False)
    assert modes == [{"mode": "reduce-overhead"}]


def test_graph_steps_copy_accumulated_gradients_without_changing_them(tiny_cfg, tmp_path, monkeypatch):
    """compile_mode reduce-overhead: each micro-batch starts a graph step, and a gradient that another micro-batch
    will add to is first copied out of the backward graph's output (pytorch#169545); the losses stay those of the
    same run without it (here the model itself stands in for its compiled form)."""
    from elastic_ssm import models

    monkeypatch.setattr(models, "compile_model", lambda m, **kw: m)
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(1) or real_clone(t, *a, **k))
    kw = dict(steps=3, grad_accum=2, recipe="dense")
    plain = train(tiny_cfg, _micro_batches(6), _cfg(tmp_path / "p", **kw), progress=False)
    n_plain = len(clones)
    graphed = train(tiny_cfg, _micro_batches(6), _cfg(tmp_path / "g", compile=True, compile_scope="model",
                                                     compile_mode="reduce-overhead", **kw), progress=False)
    assert len(marks) == 3 * 2
    n_params = sum(p.requires_grad for p in graphed.model.parameters())
    assert len(clones) - 2 * n_plain == 3 * n_params   # each parameter copied after each step's first backward
    assert [h["loss"] for h in graphed.history] == [h["loss"] for h in plain.history]
    assert [h["grad_norm"] for h in graphed.history] == [h["grad_norm"] for h in plain.history]


def test_bf16_autocast_training_with_the_torch_scan(tiny_cfg, tmp_path, monkeypatch):
    """``precision='bf16'`` with the torch scan (no fla): a mode too steep for a factorised block makes the scan
    plan mixed (Eq. 27 pairwise + factorised), the case that failed under autocast (issue #19)."""
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    kinds, real = [], ct._plan
    monkeypatch.setattr(ct, "_plan", lambda *a: (lambda p: kinds.append(p[2]) or p)(real(*a)))
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "torch")
    model = _tiny(tiny_cfg)
    with torch.no_grad():
        model.blocks[0].mixer.rho_raw[-1, -1] = 8.0        # -log rho ~ 8 per position: 128 over a 16-block
    res = train(model, _micro_batches(4), _cfg(tmp_path, steps=2, precision="bf16"), progress=False)
    assert "mixed" in kinds and all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in res.history)
