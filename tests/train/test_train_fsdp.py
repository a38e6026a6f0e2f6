"""FSDP2 (``TrainConfig.parallel='fsdp'``) on CPU with gloo: two processes of capacity-mixed training with
FFN importance ordering match one process with the same global batch, a mid-run resume continues to the
same final parameters, checkpoints and the final model hold ordinary (unsharded) tensors."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import finish_rank
from torch.distributed.tensor import DTensor

import elastic_ssm as es
from elastic_ssm.train import TrainConfig, find_checkpoint, train

L, B = 16, 2
STEPS = 4


def _tokens(n=6000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def _cfg(out_dir, **kw):
    base = dict(steps=STEPS, micro_batch_size=B, grad_accum=2, seq_len=L, out_dir=str(out_dir),
                eval={"every": 0, "batches": 1, "tiers": ("T2",)}, checkpoint={"every": 0}, log_every=1,
                mixing={"n_warm_tokens": 0, "full_share": 0.5}, ordering={"every": 1}, device="cpu")
    return TrainConfig(**{**base, **kw})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(res):
    ffn = res.model.ffn_layers()
    return {"loss": [h["loss"] for h in res.history], "caps": [h["capacities"] for h in res.history],
            "ordered": [bool(h.get("ffn_ordered")) for h in res.history],
            "grad_norm": [h["grad_norm"] for h in res.history],
            "state": {k: v.detach().clone() for k, v in res.model.state_dict().items()},
            "act_sq": [None if f.act_sq is None else f.act_sq.clone() for f in ffn],
            "plain": not any(isinstance(p, DTensor) for p in res.model.parameters()),
            "evals": [(e["tier"], e["loss"]) for e in res.evals],
            "path": None if res.model_path is None else str(res.model_path)}


def _fsdp_worker(rank, world, port, root, result_path):
    """Rank ``rank``: FSDP without ordering; DDP and FSDP with ordering; the FSDP run stopped after 2 steps
    and resumed."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = lambda r, w: es.data.PackedBatches(_tokens(), L, B, rank=r, world_size=w)  # noqa: E731
        val = [next(iter(es.data.PackedBatches(_tokens(seed=1), L, B, rank=rank, world_size=world)))]
        tiny = es.ESSHConfig.preset("tiny")
        out = {}
        plain = train(tiny, data, _cfg(f"{root}/plain", parallel="fsdp", ordering={"every": 0}), progress=False)
        out["plain"] = _summary(plain) if rank == 0 else None
        ddp = train(tiny, data, _cfg(f"{root}/ddp", parallel="ddp"), val_data=val, progress=False)
        out["ddp"] = _summary(ddp) if rank == 0 else None
        straight = train(tiny, data, _cfg(f"{root}/straight", parallel="fsdp"), val_data=val, progress=False)
        out["straight"] = _summary(straight) if rank == 0 else None
        first = train(tiny, data, _cfg(f"{root}/resumed", parallel="fsdp"), progress=False, stop_after=2)
        out["first"] = _summary(first) if rank == 0 else None
        rest = train(tiny, data, _cfg(f"{root}/resumed", parallel="fsdp"), progress=False, resume=True)
        out["rest"] = _summary(rest) if rank == 0 else None
        if rank == 0:
            torch.save(out, result_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()       # a barrier, then exit without gloo's teardown (tests/gloo_ranks.py)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    result = root / "result.pt"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mp.spawn(_fsdp_worker, args=(2, _free_port(), str(root), str(result)), nprocs=2)
        tiny = es.ESSHConfig.preset("tiny")
        val = [next(iter(es.data.PackedBatches(_tokens(seed=1), L, 2 * B)))]
        single = train(tiny, es.data.PackedBatches(_tokens(), L, B), _cfg(root / "one", grad_accum=4),
                       val_data=val, progress=False)
        plain = train(tiny, es.data.PackedBatches(_tokens(), L, B),
                      _cfg(root / "one_plain", grad_accum=4, ordering={"every": 0}), progress=False)
    finally:
        torch.set_num_threads(n)
    return torch.load(result, weights_only=True), {"order": _summary(single), "plain": _summary(plain)}, root


def _assert_same_run(a, b, loss_tol=1e-5):
    assert a["caps"] == b["caps"]
    assert any(x != 1.0 for c in a["caps"] for x in c), "no reduced capacity was sampled"
    assert a["ordered"] == b["ordered"]
    for x, y in zip(a["loss"], b["loss"], strict=True):
        assert x == pytest.approx(y, abs=loss_tol)
    for x, y in zip(a["grad_norm"], b["grad_norm"], strict=True):
        assert x == pytest.approx(y, rel=1e-4)
    assert a["state"].keys() == b["state"].keys()
    for k, v in b["state"].items():
        torch.testing.assert_close(a["state"][k], v, rtol=1e-4, atol=1e-6)


def test_fsdp_matches_single_process(fsdp_runs):
    """Without FFN ordering, 2-rank FSDP = one process with the same global batch (losses to 1e-5)."""
    runs, single, _ = fsdp_runs
    assert runs["plain"]["plain"]
    _assert_same_run(runs["plain"], single["plain"])


def test_fsdp_with_ffn_ordering_matches_ddp_and_single_process(fsdp_runs):
    """With FFN ordering after every step, FSDP = DDP (same ranks) at every step, final state included.

    Against one process only the steps up to the first ordering agree: the importance is the
    rank-average of per-rank running statistics (Algorithm 1 line 24), which differs from the running
    statistics of one process over the same micro-batches in sequence, for DDP and FSDP alike.
    """
    runs, single, _ = fsdp_runs
    fsdp, ddp, one = runs["straight"], runs["ddp"], single["order"]
    assert fsdp["plain"] and sum(fsdp["ordered"]) >= 2
    _assert_same_run(fsdp, ddp)
    for a, b in zip(fsdp["act_sq"], ddp["act_sq"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    assert [t for t, _ in fsdp["evals"]] == [t for t, _ in ddp["evals"]] == ["T2"]
    for (_, a), (_, b) in zip(fsdp["evals"], ddp["evals"]):
        assert a == pytest.approx(b, abs=1e-5)
    first = fsdp["ordered"].index(True) + 2            # the first step that runs on a reordered model
    assert fsdp["caps"] == one["caps"] and fsdp["ordered"] == one["ordered"]
    for a, b in zip(fsdp["loss"][:first - 1], one["loss"][:first - 1], strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_fsdp_final_model_is_ordinary_tensors(fsdp_runs):
    runs, _, root = fsdp_runs
    fsdp = runs["straight"]
    assert fsdp["path"] == str(root / "straight" / "final")
    loaded = es.ESSH.from_pretrained(fsdp["path"])
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, fsdp["state"][k]), k


def test_fsdp_checkpoint_is_unsharded_and_resume_continues_exactly(fsdp_runs):
    runs, _, root = fsdp_runs
    straight, first, rest = runs["straight"], runs["first"], runs["rest"]
    assert first["path"] is None and len(first["loss"]) == 2
    assert straight["loss"] == first["loss"] + rest["loss"]
    assert straight["ordered"] == first["ordered"] + rest["ordered"]
    for k, v in straight["state"].items():
        assert torch.equal(rest["state"][k], v), k
    for a, b in zip(straight["act_sq"], rest["act_sq"]):
        assert torch.equal(a, b)
    ckpt = find_checkpoint(root / "resumed" / "pretrain")
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert all(isinstance(i, int) for i in opt["state"])
    w = es.ESSH.from_pretrained(ckpt / "model").blocks[0].ffn.w_in.weight
    assert not isinstance(w, DTensor) and w.shape[0] == 2 * es.ESSHConfig.preset("tiny").d_ff
    # the same Optimizer.state_dict layout as an unsharded run's checkpoint (interchangeable)
    ref = torch.load(find_checkpoint(root / "one" / "pretrain") / "optimizer.pt", weights_only=True)
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert opt["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert {k: v.shape for k, v in opt["state"][i].items()} == {k: v.shape for k, v in st.items()}
        assert not any(isinstance(v, DTensor) for v in opt["state"][i].values())
