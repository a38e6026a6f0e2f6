"""DDP equivalence check: an ESSH trained with DDP on N ranks vs one process with the same global batch.

Run on 2 GPUs (each rank trains ``--grad_accum`` micro-batches per step; the reference runs on one GPU
with ``grad_accum x N`` micro-batches of the same windows, so both see identical global batches and the
same capacity plan, ESSH Algorithm 1)::

    torchrun --nproc_per_node 2 -m benchmarks.ddp_check --steps 50
    python -m benchmarks.ddp_check --steps 10 --device cpu     # spawns 2 gloo processes itself

(the ``ddp-check`` entry of the ``train-2gpu`` bench suite runs the first).
Rank 0 prints both loss curves and their maximum absolute difference, and writes
``$OUT/ddp_check.json`` (or ``--out``) with the curves, timings and the environment. The two curves
agree to float32 reduction-order noise (CPU gloo: ~1e-6 over a few steps; GPU: larger, since cuBLAS and
NCCL reduce in different orders, and the difference grows slowly with the number of steps). This is an
equivalence report, not a timing: it prints the difference, it does not judge it. Its flags are the fields of
``DdpCheckOptions``, derived by tyro as every ``elastic-ssm`` verb's are (``cli.derive``).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from elastic_ssm import data as es_data
from elastic_ssm.config import ESSHConfig, opt
from elastic_ssm.train import TrainConfig, train


@dataclass(kw_only=True)
class DdpCheckOptions:
    """What the DDP equivalence check trains."""

    steps: int = opt(50, "optimizer steps of both runs")
    preset: str = opt("small", "ESSH preset (byte vocabulary): tiny or small")
    seq_len: int = opt(256, "tokens per sequence")
    micro_batch: int = opt(4, "sequences per micro-batch on each rank")
    grad_accum: int = opt(2, "micro-batches per step on each DDP rank")
    precision: Literal["fp32", "bf16"] = opt("fp32", "fp32, or bf16 autocast")
    device: str = opt("auto", "auto | cpu | cuda")
    nproc: int = opt(2, "processes to spawn when not under torchrun")
    out: str = opt("", "directory for ddp_check.json (default: $OUT, if set)")


def _args(argv=None) -> DdpCheckOptions:
    from elastic_ssm.cli_util import derive

    a = derive(DdpCheckOptions, argv, "python -m benchmarks.ddp_check", __doc__.split("\n")[0])
    a.out = a.out or os.environ.get("OUT", "")
    return a


def _tokens(max_bytes: int = 4_000_000):
    """Byte tokens of the embedded stdlib corpus (learnable text, so the curves move)."""
    return es_data.load_corpus("stdlib", "bytes", split="train", max_bytes=max_bytes)


def _config(a: DdpCheckOptions, out_dir: str, grad_accum: int, world: int) -> TrainConfig:
    """Full capacity for the first 4 steps (same global token count in both runs), then mixing."""
    warm = a.micro_batch * a.seq_len * grad_accum * world * 4
    return TrainConfig(steps=a.steps, micro_batch_size=a.micro_batch, grad_accum=grad_accum,
                       seq_len=a.seq_len, optim={"lr": 1e-3, "warmup_frac": 0.1},
                       mixing={"n_warm_tokens": warm, "full_share": 0.5}, ordering={"every": 10},
                       eval={"every": 0}, checkpoint={"every": 0}, log_every=10,
                       precision=a.precision, device=a.device, out_dir=out_dir, seed=0)


def _run(a: DdpCheckOptions) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tokens = _tokens()
    model_cfg = ESSHConfig.preset(a.preset)
    # one run directory shared by all ranks (checkpoints hold one file per rank)
    base = os.path.join(tempfile.gettempdir(), f"ddp_check_{os.environ.get('MASTER_PORT', 'single')}")
    data = lambda r, w: es_data.PackedBatches(tokens, a.seq_len, a.micro_batch, seed=0, rank=r, world_size=w)

    t0 = time.perf_counter()
    # a scratch directory: an earlier check's run there is moved aside (train refuses to mix two runs)
    ddp = train(model_cfg, data, _config(a, f"{base}/ddp", a.grad_accum, world), progress=rank == 0, overwrite=True)
    t_ddp = time.perf_counter() - t0
    if rank != 0:
        return
    t0 = time.perf_counter()
    single = train(model_cfg, data(0, 1), _config(a, f"{base}/single", a.grad_accum * world, 1),
                   progress=True, distributed=False, overwrite=True)
    t_single = time.perf_counter() - t0

    la, lb = [h["loss"] for h in ddp.history], [h["loss"] for h in single.history]
    same_plan = [h["capacities"] for h in ddp.history] == [h["capacities"] for h in single.history]
    diffs = [abs(x - y) for x, y in zip(la, lb)]
    print(f"\n{'step':>5} {'ddp loss':>12} {'single loss':>12} {'|diff|':>10}  capacities")
    for h, x, y, d in zip(ddp.history, la, lb, diffs):
        print(f"{h['step']:>5} {x:>12.6f} {y:>12.6f} {d:>10.2e}  {h['capacities']}")
    param_diff = max((p.float() - q.float()).abs().max().item()
                     for p, q in zip(ddp.model.state_dict().values(), single.model.state_dict().values()))
    print(f"\nworld={world} max |loss diff| = {max(diffs):.3e}; max |param diff| = {param_diff:.3e}; "
          f"same capacity plan: {same_plan}; time ddp {t_ddp:.1f}s single {t_single:.1f}s")
    report = {"world_size": world, "steps": a.steps, "preset": a.preset, "seq_len": a.seq_len,
              "micro_batch": a.micro_batch, "grad_accum_per_rank": a.grad_accum, "precision": a.precision,
              "ddp_loss": la, "single_loss": lb, "max_abs_loss_diff": max(diffs),
              "max_abs_param_diff": param_diff,
              "same_capacity_plan": same_plan, "time_ddp_s": t_ddp, "time_single_s": t_single,
              "ddp_tokens_per_s": [h["tokens_per_s"] for h in ddp.history],
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "ddp_check.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {Path(a.out) / 'ddp_check.json'}")


def _spawned(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run(_args(argv))


def main(argv=None) -> None:
    a = _args(argv)
    if "RANK" in os.environ:
        _run(a)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(a.nproc, port, list(argv or [])), nprocs=a.nproc)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
