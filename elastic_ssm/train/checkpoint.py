"""Atomic, resumable training checkpoints: the ``step_XXXXXXX/`` layout, ``COMPLETE.json``, ``latest`` and what
happens to a damaged one (``move_damaged``, never deleted): docs/training.md, "Checkpoints and resume" and "Work
is never lost". Under FSDP2 the full states are gathered to rank 0."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config.base import config_changes
from ..models.model_dir import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, file_sha256
from ..utils.files import atomic_write_bytes, free_stamped_path, fsync_dir
from .dist import DistContext, barrier, broadcast_object, is_sharded

__all__ = ["DataStream", "save_checkpoint", "load_checkpoint", "find_checkpoint", "valid_checkpoints",
           "checkpoint_dirs", "rng_state", "set_rng_state", "full_model_state", "COMPLETE",
           "LATEST", "checkpoint_fault", "move_damaged", "file_sha256"]

COMPLETE, LATEST = "COMPLETE.json", "latest"
_STEP_NAME = re.compile(r"step_(\d+)")    # a user's copy such as step_0000040.bak is not a checkpoint


class DataStream:
    """An iterator over ``data`` that counts consumed micro-batches and resumes (by the data's own
    ``state_dict`` when it has one, else by skipping the consumed batches)."""

    def __init__(self, data: Any) -> None:
        self.data, self.consumed, self._it = data, 0, None

    def next_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next micro-batch as ``(input_ids, labels, attention_mask or None)`` on ``device``."""
        if self._it is None:
            self._it = iter(self.data)
        try:
            batch = next(self._it)
        except StopIteration:
            raise RuntimeError(f"the training data ran out after {self.consumed} micro-batches; pass an "
                               "endless iterator (PackedBatches, num_epochs=None) or fewer steps") from None
        self.consumed += 1
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise TypeError("each training micro-batch must be (input_ids, labels) or (input_ids, labels, "
                            f"attention_mask); got {type(batch).__name__}")
        moved = tuple(t.to(device, non_blocking=device.type == "cuda") for t in batch)
        return moved if len(moved) == 3 else (*moved, None)

    def state_dict(self) -> dict[str, Any]:
        inner = self.data.state_dict() if hasattr(self.data, "state_dict") else None
        return {"consumed": self.consumed, "data": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restored = state.get("data") is not None and hasattr(self.data, "load_state_dict")
        if restored:
            self.data.load_state_dict(state["data"])
        self._it = iter(self.data)
        for _ in range(0 if restored else state["consumed"]):
            next(self._it)
        self.consumed = state["consumed"]


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and CUDA generator states (plain containers, loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_torch(obj: Any, path: Path) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def checkpoint_dirs(stage_dir: Path) -> list[Path]:
    """The checkpoint directories of a stage (valid or not; a file of that name too, which fails its check),
    newest first."""
    found = [p for p in Path(stage_dir).glob("step_*") if _STEP_NAME.fullmatch(p.name) and not p.is_symlink()]
    return sorted(found, key=step_of, reverse=True)


def checkpoint_fault(path: Path) -> str | None:
    """What makes checkpoint directory ``path`` unusable, naming the file; None when its ``COMPLETE.json`` lists
    every file at its recorded size (sizes only: ``load_checkpoint`` compares the hashes)."""
    marker = path / COMPLETE
    if not path.is_dir():
        return "it is a file, not a checkpoint folder"
    if not marker.is_file():
        return f"it has no {COMPLETE} (its save or its deletion was cut short)"
    try:
        files = json.loads(marker.read_text())["files"]
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            got = f.stat().st_size
            if got != size:
                return f"{name} is {got} bytes but {COMPLETE} records {size} (truncated or edited after the save)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{COMPLETE} is unreadable ({type(e).__name__}: {e})"
    return None


def move_damaged(path: Path) -> Path:
    """Move checkpoint directory ``path`` (``<out_dir>/<stage>/step_X``) to
    ``<out_dir>/damaged/<stage>/step_X.damaged-<UTC time>`` (nothing is deleted); returns the new path."""
    folder = path.parent.parent / "damaged" / path.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    dest = free_stamped_path(folder, f"{path.name}.damaged-")
    os.replace(path, dest)
    fsync_dir(path.parent)
    return dest


def valid_checkpoints(stage_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, newest first; incomplete ones trigger a warning."""
    out = []
    for p in checkpoint_dirs(stage_dir):
        if checkpoint_fault(p) is None:
            out.append(p)
        else:
            warnings.warn(f"skipping checkpoint {p}: no valid {COMPLETE} (incomplete or corrupted write)", stacklevel=2)
    return out


def find_checkpoint(stage_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: the newest complete directory (``latest`` names it for people and tools; a
    save cut short before it was rewritten leaves it one behind)."""
    return next(iter(valid_checkpoints(stage_dir)), None)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state of an FSDP2-sharded model on CPU (a collective; empty off rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The gathered optimizer state of a sharded ``model`` in ``Optimizer.state_dict`` form (collective;
    empty off rank 0): parameters numbered through the param groups in order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not osd:
        return {}
    index = {fqn: i for i, fqn in enumerate(f for g in osd["param_groups"] for f in g["params"])}
    groups = [{**g, "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[f]: v for f, v in osd["state"].items()}, "param_groups": groups}


def _load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor],
                  opt_state: dict[str, Any]) -> None:
    """Load full (unsharded) model and optimizer states into a sharded model; each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(order) != sum(len(g["params"]) for g in opt_state["param_groups"]):
        raise ValueError("the optimizer state has another number of parameters than the optimizer")
    osd = {"state": {order[int(i)]: v for i, v in opt_state["state"].items()},
           "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in opt_state["param_groups"]]}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def save_checkpoint(stage_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], rank_state: dict[str, Any], ctx: DistContext,
                    keep_last: int, config_yaml: str) -> Path:
    """Write checkpoint ``step`` of ``model`` (FSDP2-sharded or not) atomically; a collective of every rank."""
    stage_dir = Path(stage_dir)
    sharded = is_sharded(model)
    model_state, opt_state = (full_model_state(model), _full_optimizer_state(model, optimizer)) if sharded \
        else (None, optimizer.state_dict())
    name = f"step_{step:07d}"
    final, tmp = stage_dir / name, stage_dir / f".{name}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)      # a save of this step cut short
        tmp.mkdir(parents=True)
    barrier(ctx)
    _save_torch(rank_state, tmp / f"rank{ctx.rank}.pt")
    barrier(ctx)
    if ctx.is_main:
        model.save_pretrained(tmp / "model", state_dict=model_state)
        sums = {"optimizer.pt": _save_torch(opt_state, tmp / "optimizer.pt"),
                "trainer.pt": _save_torch(trainer_state, tmp / "trainer.pt"),
                "train_config.yaml": atomic_write_bytes(tmp / "train_config.yaml", config_yaml.encode())}
        sums[f"model/{WEIGHTS_NAME}"] = json.loads((tmp / "model" / CONFIG_NAME).read_text())["weights_sha256"]
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        sha = {f: sums[f] if f in sums else file_sha256(tmp / f) for f in files}  # rank files, config.json: small
        atomic_write_bytes(tmp / COMPLETE, json.dumps({"step": step, "files": files, "sha256": sha}, indent=1).encode())
        fsync_dir(tmp / "model")
        fsync_dir(tmp)
        if final.exists():  # a checkpoint of this step that failed to load (e.g. same-size corruption): kept
            dest = move_damaged(final)
            print(f"[train] {final} was not used (it failed to load); moved it to {dest} before saving step "
                  f"{step} again", flush=True)
        os.replace(tmp, final)
        fsync_dir(stage_dir)
        atomic_write_bytes(stage_dir / LATEST, name.encode())
        for old in valid_checkpoints(stage_dir)[keep_last:]:
            (old / COMPLETE).unlink(missing_ok=True)   # unmarked first: a prune cut short is cleaned on start-up
            fsync_dir(old)
            shutil.rmtree(old, ignore_errors=True)
    barrier(ctx)
    return final


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


class _OtherModel(ValueError):
    """A checkpoint of a model with another config: a refusal, not a damaged file to skip."""


def load_checkpoint(stage_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: DistContext) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Restore ``model`` and ``optimizer`` from the newest usable checkpoint of ``stage_dir``; returns
    ``(trainer_state, rank_state)`` (the loop applies the RNG states) or None when there is none. One that fails to
    load is skipped with a warning; one of another model config (``config_changes`` of its upgraded ``model_config``,
    less ``ModelConfig.RESUME_FREE``) is refused."""
    from safetensors.torch import load_file

    candidates = broadcast_object([str(p) for p in valid_checkpoints(stage_dir)] if ctx.is_main else [], ctx)
    sharded, cfg = is_sharded(model), getattr(model, "config", None)
    device = "cpu" if sharded else next(model.parameters()).device
    failures = []
    for cand in map(Path, candidates):
        try:        # every file against its sha256 in COMPLETE.json (checkpoints written before checksums: sizes)
            for name, digest in (json.loads((cand / COMPLETE).read_text()).get("sha256") or {}).items():
                if file_sha256(cand / name) != digest:
                    raise CheckpointError(f"{cand / name}: sha256 checksum mismatch with {COMPLETE} (same-size "
                                          "corruption)")
            trainer = _load(cand / "trainer.pt")
            saved = trainer.get("model_config") if isinstance(trainer, dict) else None
            changed = config_changes(type(cfg).upgrade_record(saved), cfg.to_dict(), cfg.RESUME_FREE) \
                if hasattr(cfg, "upgrade_record") and isinstance(saved, dict) else []
            if changed:
                raise _OtherModel(f"cannot resume from {cand}: it was written by a model with a different config "
                                  f"({'; '.join(changed)}); resume with the same model or use a new out_dir")
            state = load_file(str(cand / "model" / "model.safetensors"), device=str(device))
            opt_state = _load(cand / "optimizer.pt")
            rank_file = cand / f"rank{ctx.rank}.pt"
            if not rank_file.is_file():
                warnings.warn(f"{cand} has no {rank_file.name} (world size changed); using rank0.pt", stacklevel=2)
                rank_file = cand / "rank0.pt"
            rank_state = _load(rank_file)
            if sharded:
                _load_sharded(model, optimizer, state, opt_state)
            else:
                model.load_state_dict(state, strict=True)
                optimizer.load_state_dict(opt_state)
            return trainer, rank_state
        except _OtherModel:
            raise
        except Exception as e:  # a corrupted file of any kind: fall back to the previous checkpoint
            failures.append(f"{cand.name}: {e}")
            warnings.warn(f"could not load checkpoint {cand} ({type(e).__name__}: {e}); trying an older one",
                          stacklevel=2)
    if failures:  # checkpoints exist but none loads: never restart silently from step 0 over them
        raise CheckpointError(f"no checkpoint of {stage_dir} could be loaded ({'; '.join(failures)}); move the "
                              "directory aside to start fresh, or restore the files from a copy")
    return None
