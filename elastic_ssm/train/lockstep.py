"""Ranks in lock step: the same collectives in the same order on every rank, and no silent hang.

Under FSDP2 every rank must run the same forwards (NCCL matches collectives by position); a reduced micro-batch of
capacity mixing runs a teacher pass (Alg. 1 line 12) and a full one does not, so ``teacher_padding`` names the
micro-batches that run an idle teacher pass (``LossModule.idle_teacher``; results unchanged). A collective that
waits past ``dist_timeout_s`` becomes one line naming rank, stage and step (``collective_error``, ``StepWatch``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .dist import DistContext

__all__ = ["CollectiveError", "teacher_padding", "collective_error", "check_same_count", "StepWatch"]

_MARKERS = ("timed out", "timeout", "gloo", "nccl", "connection closed", "connection reset", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank (timeout, a peer that died or ran other collectives)."""


def teacher_padding(gplan: Sequence[Any], n_local: int, world: int, rank: int) -> list[bool]:
    """For local micro-batches ``r = 0 .. n_local - 1`` (global slot ``r x world + rank``): whether this rank
    must run an idle teacher pass because it has none and another rank's r-th micro-batch has one."""
    out = []
    for r in range(n_local):
        slots = [gplan[r * world + k] for k in range(world)]
        row = [p.distill is not None and not p.full_ce for p in slots]      # runs the no-grad KL teacher pass
        out.append(any(row) and not row[rank])
    return out


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
        self._thread = None
        if ctx.distributed and ctx.backend == "nccl":
            self._thread = threading.Thread(target=self._run, name="elastic-ssm-step-watch", daemon=True)
            self._thread.start()

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
