"""Process groups for one code path on CPU, one GPU and ``torchrun`` (docs/training.md, "Multi-GPU"):
``init_distributed`` (NCCL on CUDA, gloo on CPU; one process: collectives are the identity), ``wrap_ddp`` (Alg. 1
line 20) and ``wrap_fsdp`` (FSDP2 ``fully_shard`` per block), both averaging gradients; the same collectives on
every rank (``teacher_padding``: Alg. 1 line 12) and a stuck one as one line (``collective_error``, ``StepWatch``)."""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..utils.environment import auto_device, checked_device, env_int

__all__ = ["DistContext", "init_distributed", "all_reduce", "barrier", "wrap_ddp", "wrap_fsdp", "no_sync",
           "is_sharded", "full_tensor", "shard_like", "unsharded_copy", "CollectiveError", "teacher_padding",
           "collective_error", "check_same_count", "StepWatch"]


@dataclass
class DistContext:
    """Where this process sits: ``rank`` of ``world_size``, its ``device`` and who owns the group."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self, clean: bool = True) -> None:
        """Destroy the process group if ``init_distributed`` created it; ``clean=False`` (after an error) skips
        the final barrier, which would wait for peers that may never come (a second timeout)."""
        if self.owns_group and dist.is_initialized():
            try:
                if clean:
                    dist.barrier()  # no rank tears the group down while a peer still uses its connections
            finally:
                dist.destroy_process_group()
                self.owns_group = False


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = auto_device()[0]       # the CLI printed why not mps (utils/environment.cpu_threads_for)
    if device == "cuda":
        device = f"cuda:{local_rank}"       # checked_device refuses it without CUDA
    dev = checked_device(device, "train.device")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: str = "auto", enabled: bool | None = None, timeout_s: float = 600.0) -> DistContext:
    """Context of this process, initialising the process group from the torchrun environment (``enabled=False``:
    one process even under torchrun). ``timeout_s``: how long a collective may wait for the other ranks. On NCCL
    (unless set): ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` and, without a flight recorder,
    ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` (no 60 s wait for an empty dump, docs/benchmarks.md)."""
    if enabled is not False and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = env_int("LOCAL_RANK", rank)
        return DistContext(rank, world, _pick_device(device, local), dist.get_backend(), False)
    world = 1 if enabled is False else env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistContext(device=_pick_device(device, 0))
    if not os.environ.get("RANK", "").strip():
        raise ConfigError(f"WORLD_SIZE={world} but RANK is not set; launch with torchrun (which sets both), or "
                          "unset WORLD_SIZE for one process")
    rank = env_int("RANK", 0)
    dev = _pick_device(device, env_int("LOCAL_RANK", rank))
    backend, kw = ("nccl", {"device_id": dev}) if dev.type == "cuda" else ("gloo", {})
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") in ("", "0"):
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistContext(rank, world, dev, backend, True)


def all_reduce(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """In-place sum across ranks; identity for one process."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier(**({"device_ids": [ctx.device.index]} if ctx.backend == "nccl" else {}))


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's ``obj`` on every rank (picklable objects)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_ddp(module: nn.Module, ctx: DistContext) -> nn.Module:
    """``DistributedDataParallel`` around ``module`` on more than one rank, else ``module`` itself; buffers (fixed
    filters) are not broadcast on every forward."""
    if not ctx.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    params = inspect.signature(DDP.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DDP(module, device_ids=ids, **{key: False})


def wrap_fsdp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """FSDP2 ``fully_shard`` on every block of ``model`` and then on the root, in place, before the optimizer is
    built; one process: ``model`` unchanged."""
    if not ctx.distributed:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"TrainConfig.parallel='fsdp' shards a model block by block, but "
                         f"{type(model).__name__} has no non-empty 'blocks' ModuleList; use parallel='ddp'")
    # parameters and gradients stay fp32: bf16 comes from the loop's autocast, and the modal tables (rho ~ 1 - 1e-4,
    # theta) must not be rounded to bf16 (E.5: fp32 master weights and scan)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if hasattr(model, "hidden_states"):
        register_fsdp_forward_method(model, "hidden_states")
    return model


def _is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (about 2 s of CLI start-up):
    while that module is not loaded, no ``DTensor`` can exist."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are FSDP2 ``DTensor`` shards."""
    return any(_is_dtensor(p) for p in module.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded) value of ``t``: a collective for a ``DTensor``, ``t`` itself otherwise."""
    return t.detach().full_tensor() if _is_dtensor(t) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) laid out like ``like``: a ``DTensor`` with ``like``'s mesh and
    placements (each rank keeps its own chunk, no communication), or ``full`` for a plain ``like``."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), like.device_mesh, like.placements, src_data_rank=None)


@contextlib.contextmanager
def no_sync(module: nn.Module, skip_sync: bool):
    """Skip the gradient reduction of this backward when ``skip_sync``: ``module.no_sync()`` for DDP,
    ``set_requires_gradient_sync(False)`` for an FSDP2 module."""
    if not skip_sync:
        yield
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        with module.no_sync() if hasattr(module, "no_sync") else contextlib.nullcontext():
            yield


def unsharded_copy(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A plain (non-FSDP) model of ``model``'s class and config holding ``state`` and the FFN statistics."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    with torch.random.fork_rng(devices=[]):
        plain = cls(model.config)
    plain.load_state_dict(state, strict=True)
    plain.tokenizer = getattr(model, "tokenizer", None)
    plain.to(device).train(model.training)
    if hasattr(model, "ffn_layers"):
        for src, dst in zip(model.ffn_layers(), plain.ffn_layers()):
            dst.track_activations, dst.stat_decay = src.track_activations, src.stat_decay
            dst.act_sq = src.act_sq
    return plain


_MARKERS = ("timed out", "timeout", "gloo", "nccl", "connection closed", "connection reset", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank (timeout, a peer that died or ran other collectives)."""


def teacher_padding(gplan: Sequence[Any], n_local: int, world: int, rank: int) -> list[bool]:
    """For local micro-batches ``r = 0 .. n_local - 1`` (global slot ``r x world + rank``): whether this rank
    must run an idle teacher pass because it has none and another rank's r-th micro-batch has one."""
    rows = [[p.distill is not None and not p.full_ce for p in gplan[r * world:(r + 1) * world]]  # a KL teacher pass
            for r in range(n_local)]
    return [any(row) and not row[rank] for row in rows]


def collective_error(e: BaseException, ctx: DistContext, where: tuple[str, int] | None,
                     timeout_s: float) -> BaseException:
    """``e`` itself, or for a failed collective of a distributed run a one-line ``CollectiveError`` naming the
    rank and the step (the original error is chained)."""
    failed = isinstance(e, torch.distributed.DistError) or isinstance(e, RuntimeError) and any(
        m in str(e).lower() for m in _MARKERS)
    if not ctx.distributed or isinstance(e, CollectiveError) or not failed:
        return e
    step = f"{where[0]} step {where[1]}" if where else "start-up (before the first step)"
    first = " ".join(str(e).split())[:300]
    return CollectiveError(
        f"rank {ctx.rank} of {ctx.world_size}: a collective of {step} did not complete ({type(e).__name__}: "
        f"{first}); another rank failed, stopped or ran a different sequence of collectives (the process-group "
        f"timeout is {timeout_s:g} s, --train.dist_timeout_s); see that rank's error")


def check_same_count(n: int, ctx: DistContext, what: str) -> None:
    """Raise on every rank unless ``n`` is the same on all of them (a collective; one process: nothing)."""
    if not ctx.distributed:
        return
    t = torch.tensor([n, -n], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # [max n, -min n]
    if t[0].item() != -t[1].item():
        raise ValueError(f"{what}: rank {ctx.rank} has {n}, the ranks have between {int(-t[1].item())} and "
                         f"{int(t[0].item())}; under parallel='fsdp' every rank must run the same number of "
                         "forward passes: give every rank the same number of batches")


class StepWatch:
    """A daemon thread that prints one line naming the rank and the step when a step has run for
    ``timeout_s - margin`` seconds (NCCL runs only: its watchdog then aborts the process at the timeout)."""

    def __init__(self, ctx: DistContext, timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s
        self.where: tuple[str, int] | None = None
        self._since = time.monotonic()
        self._stop = threading.Event()
        if ctx.distributed and ctx.backend == "nccl":
            threading.Thread(target=self._run, name="elastic-ssm-step-watch", daemon=True).start()

    def mark(self, stage: str, step: int) -> None:
        """This rank starts ``stage`` step ``step`` (1-based) now."""
        self.where, self._since = (stage, step), time.monotonic()

    def _run(self) -> None:
        limit = max(self.timeout_s - min(30.0, 0.1 * self.timeout_s), 1.0)
        told = None
        while not self._stop.wait(1.0):
            if self.where is not None and self.where != told and time.monotonic() - self._since > limit:
                told = self.where
                print(f"elastic-ssm train: rank {self.ctx.rank} of {self.ctx.world_size}: {self.where[0]} step "
                      f"{self.where[1]} has run for {limit:.0f} s: if a collective is waiting for another rank it "
                      f"fails at the {self.timeout_s:g} s process-group timeout (--train.dist_timeout_s; first "
                      f"fla/Triton autotuning of new shapes can also take minutes: raise it if so)",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
