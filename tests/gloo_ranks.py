"""Ending a spawned gloo rank of a CPU test without ``destroy_process_group``.

A CI run of ``tests/train/test_train_fsdp.py`` once lost rank 1 with "terminate called without an active
exception" (SIGABRT), and ``mp.spawn`` then failed the whole module. Where it aborted was not recorded; a C++
thread of gloo ended during ``destroy_process_group`` is the likely place (the test already had a barrier
before it for an abort at exit), so the ranks no longer tear gloo down. A rank whose results are written and
which has met every other rank at a barrier has nothing left to tear down that the operating system does not
(sockets, memory), so it leaves with ``os._exit(0)`` and runs no C++ destructor. A rank that fails before that
point still tears down and raises, so its error reaches ``mp.spawn``. The same abort hit rank 1 of
``tests/train/test_train_end_to_end.py::test_ddp_gloo_matches_single_process`` (then in ``test_train.py``) once
in three CI runs on 2026-12-01, where ``train()`` owned the group and destroyed it; that test now ends its ranks
here too.
"""

import os
import sys

import torch.distributed as dist


def finish_rank() -> None:
    """Meet every rank at a barrier, then end this process at once with exit code 0."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
