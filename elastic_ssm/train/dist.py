"""Process-group set-up for one code path on CPU, one GPU and ``torchrun`` (DDP).

``init_distributed`` reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); with ``WORLD_SIZE > 1`` it initialises the default process group
(NCCL on CUDA, gloo on CPU) unless one exists already. Without those variables it returns a
single-process context and every collective below is the identity, so the training loop never
branches on the world size.

The loop wraps its ``LossModule`` in ``DistributedDataParallel`` (``wrap_ddp``): gradients of the M
micro-batches are accumulated locally under ``no_sync`` and all-reduced once with the last backward
(ESSH Algorithm 1 line 20). DDP *averages* over ranks, so the loop scales each micro-batch loss by the
world size to obtain the sum of Algorithm 1. FSDP2 is not used: its sharded (DTensor) parameters and
optimizer moments would need their own permutation (D.3) and checkpoint code; the 370M/1.5B presets
with fp32 AdamW state fit one H200 each, which is what plain DDP needs.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistContext", "init_distributed", "all_reduce", "barrier", "wrap_ddp", "no_sync", "unwrap"]


@dataclass
class DistContext:
    """Where this process sits: ``rank`` of ``world_size``, its ``device`` and who owns the group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        """Destroy the process group if ``init_distributed`` created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("TrainConfig.device='cuda' but CUDA is not available; use 'cpu' or 'auto'")
        device = f"cuda:{local_rank}"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: str = "auto", enabled: bool | None = None) -> DistContext:
    """Context of this process; initialises the process group from the torchrun environment.

    ``enabled=False`` forces a single-process context even under torchrun (used by
    ``scripts/ddp_check.py`` to run the single-GPU reference inside a torchrun job).
    """
    if enabled is False:
        return DistContext(device=_pick_device(device, 0))
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return DistContext(rank, world, local, _pick_device(device, local), dist.get_backend(), False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(device=_pick_device(device, 0))
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = _pick_device(device, local)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30), **kw)
    return DistContext(rank, world, local, dev, backend, True)


def all_reduce(t: torch.Tensor, ctx: DistContext, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (``'sum'`` or ``'mean'``) across ranks; identity for one process."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if op == "mean":
            t.div_(ctx.world_size)
    return t


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def broadcast_object(obj, ctx: DistContext, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def wrap_ddp(module: nn.Module, ctx: DistContext) -> nn.Module:
    """``DistributedDataParallel`` around ``module`` on more than one rank, else ``module`` itself.

    Buffers are not broadcast on every forward (the models' buffers are fixed filters); parameters are
    broadcast from rank 0 once, at construction.
    """
    if not ctx.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    params = inspect.signature(DDP.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DDP(module, device_ids=ids, **{key: False})


def no_sync(module: nn.Module, skip_sync: bool):
    """``module.no_sync()`` when ``skip_sync`` and ``module`` is DDP, else a null context."""
    if skip_sync and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside DDP / ``torch.compile`` wrappers."""
    while True:
        if hasattr(module, "module") and isinstance(module.module, nn.Module):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module
