"""Ranks in lock step on CPU with gloo (issue #19): capacity-mixed FSDP2 with ranks at different capacities in
the same step equals one process; checkpoints move between one process and FSDP2 (resharding) in both
directions; a collective that one rank never joins ends in a one-line error naming the rank and the step
within a bounded time instead of a hang."""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import finish_rank

import elastic_ssm as es
from elastic_ssm.train import TrainConfig, find_checkpoint, train
from elastic_ssm.train.dist import teacher_padding

L, B, STEPS = 16, 2, 4
# one reserved full slot per step (slots 0, 1 of 4 are r = 0 on both ranks); slots 2, 3 (r = 1) draw from
# a full and a reduced capacity, so some steps have one rank at full and the other at 1/4 in micro-batch 1
CAPS = (0.25, 1.0)


def _tokens(n=6000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def _cfg(out_dir, **kw):
    base = dict(steps=STEPS, micro_batch_size=B, grad_accum=2, seq_len=L, out_dir=str(out_dir),
                eval={"every": 0, "batches": 1, "tiers": ("T2",)}, checkpoint={"every": 0}, log_every=1,
                mixing={"n_warm_tokens": 0, "full_share": 0.5, "capacities": CAPS}, device="cpu", seed=3,
                ordering={"every": 100})   # ordering.every > steps: tracking only
    return TrainConfig(**{**base, **kw})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _summary(res, rank=0):
    return {"loss": [h["loss"] for h in res.history], "caps": [h["capacities"] for h in res.history],
            "state": {k: v.detach().clone() for k, v in res.model.state_dict().items()} if rank == 0 else None,
            "act_sq": [f.act_sq.clone() for f in res.model.ffn_layers()]}


def _data(r, w):
    return es.data.PackedBatches(_tokens(), L, B, rank=r, world_size=w)


def _worker(rank, world, port, root, result_path):
    _env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        tiny, out = es.ESSHConfig.preset("tiny"), {}
        val = [next(iter(es.data.PackedBatches(_tokens(seed=1), L, B)))]   # the same batch on every rank
        out["fsdp"] = _summary(train(tiny, _data, _cfg(f"{root}/fsdp", parallel="fsdp"), val_data=val,
                                     progress=False), rank)
        out["ddp"] = _summary(train(tiny, _data, _cfg(f"{root}/ddp"), progress=False), rank)
        out["half"] = _summary(train(tiny, _data, _cfg(f"{root}/fsdp_half", parallel="fsdp"), progress=False,
                                     stop_after=2), rank)
        # a one-process checkpoint (grad_accum 4) resumed on 2 FSDP2 ranks (grad_accum 2: the same global batch)
        out["resharded"] = _summary(train(tiny, _data, _cfg(f"{root}/one_half", parallel="fsdp"), progress=False,
                                          resume=True), rank)
        torch.save(out, f"{result_path}.{rank}")
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()       # a barrier, then exit without gloo's teardown (tests/gloo_ranks.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lockstep")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny, one = es.ESSHConfig.preset("tiny"), _data(0, 1)
        single = _summary(train(tiny, one, _cfg(root / "one", grad_accum=4), progress=False))
        train(tiny, _data(0, 1), _cfg(root / "one_half", grad_accum=4), progress=False, stop_after=2)
        mp.spawn(_worker, args=(2, _free_port(), str(root), str(root / "result.pt")), nprocs=2)
        # the FSDP2 run's checkpoint after 2 steps, continued by one process
        cont = _summary(train(tiny, _data(0, 1), _cfg(root / "fsdp_half", grad_accum=4), progress=False,
                              resume=True))
    finally:
        torch.set_num_threads(n)
    ranks = [torch.load(root / f"result.pt.{r}", weights_only=True) for r in range(2)]
    return ranks, single, cont, root


def _assert_close_runs(a, b, loss_tol=1e-5):
    assert a["caps"] == b["caps"]
    for x, y in zip(a["loss"], b["loss"], strict=True):
        assert x == pytest.approx(y, abs=loss_tol)
    assert a["state"].keys() == b["state"].keys()
    for k, v in b["state"].items():
        torch.testing.assert_close(a["state"][k], v, rtol=1e-4, atol=1e-6)


def test_teacher_padding():
    class P:
        def __init__(self, distill, full_ce=False):
            self.distill, self.full_ce = distill, full_ce

    kl, full, tv = P(("kl", 0.5)), P(None), P(("tv", 5.0), True)
    gplan = [full, full, kl, full, full, full, tv, tv]      # 2 ranks x 4 micro-batches, slot g = r x 2 + rank
    assert teacher_padding(gplan, 4, 2, 0) == [False, False, False, False]
    assert teacher_padding(gplan, 4, 2, 1) == [False, True, False, False]
    assert teacher_padding(gplan, 8, 1, 0) == [False] * 8


def test_capacity_mixed_fsdp_with_ranks_at_different_capacities_equals_one_process(runs):
    """ESSH Alg. 1 under FSDP2: a step where one rank's micro-batch is full and the other's reduced (only the
    latter has a teacher pass) no longer hangs, and the run equals one process (loss 1e-5, weights 1e-4)."""
    ranks, single, _, _ = runs
    fsdp = ranks[0]["fsdp"]
    split = [c for c in fsdp["caps"] if (c[2] == 1.0) != (c[3] == 1.0)]
    assert split, f"no step put the ranks' micro-batch 1 at full and reduced capacity: {fsdp['caps']}"
    _assert_close_runs(fsdp, single)


def test_idle_teacher_passes_leave_ffn_statistics_alone(runs):
    """Each rank's FFN activation statistics equal DDP's on the same rank (DDP runs no idle passes)."""
    ranks, _, _, _ = runs
    for r in ranks:
        for a, b in zip(r["fsdp"]["act_sq"], r["ddp"]["act_sq"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


def test_fsdp_checkpoint_loads_and_continues_on_one_process(runs):
    """An FSDP2 checkpoint holds the whole model (loads on one CPU process) and one process continues it to
    the uninterrupted one-process run (loss 1e-5, weights 1e-4: reduction order differs)."""
    ranks, single, cont, root = runs
    half = ranks[0]["half"]
    assert find_checkpoint(root / "fsdp_half" / "pretrain").name == f"step_{STEPS:07d}"   # written by `cont`
    loaded = es.ESSH.from_pretrained(root / "fsdp_half" / "pretrain" / "step_0000002" / "model")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, half["state"][k]), k
    assert half["loss"] + cont["loss"] == pytest.approx(single["loss"], abs=1e-5)
    _assert_close_runs({**cont, "loss": half["loss"] + cont["loss"], "caps": half["caps"] + cont["caps"]}, single)


def test_one_process_checkpoint_resumes_under_fsdp(runs):
    """A one-process checkpoint resumes on 2 FSDP2 ranks (resharded) with grad_accum halved; the continuation
    equals the uninterrupted one-process run (loss 1e-5, weights 1e-4)."""
    ranks, single, _, _ = runs
    resharded = ranks[0]["resharded"]
    assert len(resharded["loss"]) == STEPS - 2
    _assert_close_runs({**resharded, "loss": single["loss"][:2] + resharded["loss"],
                        "caps": single["caps"][:2] + resharded["caps"]}, single)


class _ExtraCollective:
    """Micro-batches of ``inner``; at the third, rank 1 runs an all-reduce that rank 0 never joins (rank 0
    is busy elsewhere for longer than the timeout)."""

    def __init__(self, inner, rank):
        self.inner, self.rank, self.n = iter(inner), rank, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        if self.n == 3 and self.rank == 1:
            dist.all_reduce(torch.ones(3))
        elif self.n == 3:
            time.sleep(4.0)
        return next(self.inner)


def _timeout_worker(rank, port, root, queue):
    _env(rank, 2, port)   # train() creates the process group itself, with the configured timeout
    cfg = _cfg(f"{root}/stuck", recipe="dense", dist_timeout_s=1.5, steps=4, grad_accum=1)
    try:
        train(es.ESSHConfig.preset("tiny"), lambda r, w: _ExtraCollective(_data(r, w), r), cfg, progress=False)
        queue.put((rank, "finished", ""))
    except Exception as e:
        queue.put((rank, type(e).__name__, str(e)))


def test_mismatched_collective_is_an_error_naming_rank_and_step(tmp_path):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_timeout_worker, args=(r, port, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120            # the guard: a hang fails the test instead of blocking it
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(alive), "a rank still hangs 120 s after the start"
    got = {}
    while len(got) < 2:
        rank, kind, msg = queue.get(timeout=10)
        got[rank] = (kind, msg)
    kind, msg = got[1]
    assert kind == "CollectiveError" and "\n" not in msg
    assert msg.startswith("rank 1 of 2: a collective of pretrain step 3 did not complete") and "1.5 s" in msg
    assert got[0][0] == "CollectiveError" and got[0][1].startswith("rank 0 of 2: ")
