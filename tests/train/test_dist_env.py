"""``init_distributed``'s NCCL environment defaults (CPU: the process-group call is replaced, nothing connects)."""
import os

import torch

from elastic_ssm.train import dist as dist_mod


def _init_as_nccl_rank(monkeypatch, env):
    seen = {}
    for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", **env}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist_mod, "_pick_device", lambda device, local: torch.device("cuda", local))
    monkeypatch.setattr(dist_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist_mod.dist, "init_process_group",
                        lambda backend, **kw: seen.update(backend=backend, timeout=kw["timeout"].total_seconds()))
    ctx = dist_mod.init_distributed("cuda", timeout_s=20)
    assert (ctx.rank, ctx.world_size, seen["backend"], seen["timeout"]) == (1, 2, "nccl", 20.0)
    return {k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT")}


def test_nccl_timeout_ends_the_process_without_waiting_for_an_empty_dump(monkeypatch):
    env = _init_as_nccl_rank(monkeypatch, {})
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def test_a_flight_recorder_keeps_its_dump_and_user_settings_win(monkeypatch):
    env = _init_as_nccl_rank(monkeypatch, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] is None
    env = _init_as_nccl_rank(monkeypatch, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
