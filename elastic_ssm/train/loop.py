"""``train()``: one code path for CPU, one GPU and ``torchrun`` DDP or FSDP2 (ESSH Algorithm 1; ES-SSM Alg. 2).

One optimizer step of every recipe (docs/training.md, "One optimizer step": Alg. 1 lines 2-26): N_tok valid
tokens all-reduced, the recipe's plan per micro-batch, backward of ``world x sum / N_tok`` for each, clip, LR,
AdamW, the recipe's hook (FFN ordering); then log, validate and checkpoint at their cadences.

Stages: ``pretrain`` and, for ESSH with ``refine.steps > 0``, ``refine`` (D.8: a fresh AdamW and schedule), each
into ``<out_dir>/<stage>/``; a resume continues an interrupted stage bit for bit on CPU."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigBase, ConfigError, TrainConfig, resolve_precision
from . import checkpoint, dist
from .losses import IGNORE_INDEX, LossModule
from .metrics import MetricsLogger, bytes_per_token, eval_tier_list, validation_records
from .preflight import StopSignals, TrainingInterrupted, config_changes, start_run
from .recipes import WarmupCosine, build_adamw, make_recipe, resolve_recipe_name

__all__ = ["train", "refine", "TrainResult"]


@dataclass
class TrainResult:
    """``history``: one record per optimizer step (all stages); ``evals``: validation records; ``model_path``: the
    final model directory; ``model``: the trained model (fsdp: an unsharded copy on rank 0, shards elsewhere)."""

    history: list[dict[str, Any]]
    model_path: Path | None
    model: nn.Module
    evals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Stage:
    name: str
    recipe_name: str
    steps: int
    sched: WarmupCosine          # its peak is the stage's lr
    weight_decay: float
    accum: int


def _stages(cfg: TrainConfig, recipe: str, only: tuple[str, ...] | None, world: int) -> list[_Stage]:
    out = []
    if only is None or "pretrain" in only:
        sched = WarmupCosine(cfg.optim.lr, cfg.steps, cfg.warmup_steps, cfg.optim.min_lr_frac)
        out.append(_Stage("pretrain", recipe, cfg.steps, sched, cfg.optim.weight_decay, cfg.micro_batches(world)))
    r = cfg.refine
    if (only is None and r.steps > 0 and recipe == "capacity_mixed") or (only and "refine" in only):
        if r.steps < 1:
            raise ValueError("refine(): TrainConfig.refine.steps must be >= 1")
        sched = WarmupCosine(r.lr, r.steps, round(r.warmup_frac * r.steps), r.min_lr_frac)
        out.append(_Stage("refine", "refine", r.steps, sched, r.weight_decay, cfg.micro_batches(world, "refine")))
    return out


class _Trainer:
    """State shared by the stages of one ``train()`` call."""

    def __init__(self, model: nn.Module, data: Any, cfg: TrainConfig, ctx: dist.DistContext, val_data: Any,
                 progress: bool | str, stop: StopSignals) -> None:
        self.model, self.cfg, self.ctx, self.stop = model, cfg, ctx, stop
        factory = callable(data) and not hasattr(data, "__iter__")
        self.data = data(ctx.rank, ctx.world_size) if factory else data
        self.stream = checkpoint.DataStream(self.data)
        self.out = Path(cfg.out_dir)
        self.log = MetricsLogger(self.out, ctx, progress, cfg.log, cfg.to_dict())
        self.val_data, self._val = val_data, None
        self.bpb = bytes_per_token(cfg, model)
        self.sharded = cfg.parallel == "fsdp" and ctx.distributed
        self.watch = dist.StepWatch(ctx, cfg.dist_timeout_s)
        self.precision = resolve_precision(cfg.precision, ctx.device)
        fsdp = cfg.parallel == "fsdp"   # FSDP2 shards the model in place; DDP wraps the loss module
        self.loss_mod = LossModule(dist.wrap_fsdp(model, ctx)) if fsdp else dist.wrap_ddp(LossModule(model), ctx)
        self.sync_mod: nn.Module = model if fsdp else self.loss_mod
        self._shape_checked = False
        #: compile_mode reduce-overhead replays CUDA graphs whose outputs the next replay overwrites: each
        #: micro-batch starts a new graph step (its outputs are consumed by its own backward and loss sums)
        self.graph_steps = cfg.compile and cfg.compile_mode == "reduce-overhead"

    def _check_shape(self, ids: torch.Tensor) -> None:
        """Warn once when the data's batch shape differs from ``micro_batch_size x seq_len``."""
        want = (self.cfg.micro_batch_size, self.cfg.seq_len)
        if not self._shape_checked and tuple(ids.shape) != want and self.ctx.is_main:
            warnings.warn(f"micro-batches have shape {tuple(ids.shape)} but TrainConfig says "
                          f"micro_batch_size x seq_len = {want}; token counts (n_warm_tokens, tokens/s) "
                          "follow the data", stacklevel=3)
        self._shape_checked = True

    # ---- validation / checkpoints ---------------------------------------------------------------
    def evaluate(self, stage: str, step: int) -> None:
        if self.val_data is None:
            return
        if self._val is None:
            self._val = list(islice(iter(self.val_data), self.cfg.eval.batches))   # a one-shot iterator: read once
            if self.sharded:
                dist.check_same_count(len(self._val), self.ctx, "validation batches")
        tiers = eval_tier_list(self.model, self.cfg.eval.tiers)
        recs = validation_records(self.model, self._val, tiers, self.ctx, self.bpb, self.precision)
        self.log.eval_results([{**r, "stage": stage, "step": step} for r in recs])

    def rank_state(self) -> dict[str, Any]:
        stats = [f.act_sq for f in self.model.ffn_layers()] if hasattr(self.model, "ffn_layers") else []
        return {"rng": checkpoint.rng_state(), "act_sq": [None if s is None else s.cpu() for s in stats],
                "data": self.stream.state_dict()}

    def save(self, st: _Stage, step: int, tokens: int, opt: torch.optim.Optimizer, recipe: Any) -> None:
        trainer = {"stage": st.name, "step": step, "tokens_seen": tokens, "schedule": st.sched.state_dict(),
                   "recipe": recipe.state_dict(), "train_config": self.cfg.to_dict(),
                   "model_config": self.model.config.to_dict(), "world_size": self.ctx.world_size}
        checkpoint.save_checkpoint(self.out / st.name, step, self.model, opt, trainer, self.rank_state(), self.ctx,
                                   self.cfg.checkpoint.keep_last, self.cfg.to_yaml())

    def restore(self, st: _Stage, opt: torch.optim.Optimizer, recipe: Any) -> tuple[int, int]:
        got = checkpoint.load_checkpoint(self.out / st.name, self.model, opt, self.ctx)
        if got is None:
            return 0, 0
        trainer, rank = got
        W = self.ctx.world_size
        saved = TrainConfig.upgrade_record(trainer.get("train_config") or self.cfg.to_dict())
        world = int(trainer.get("world_size", W))
        changed = config_changes(saved, self.cfg.to_dict(), self.cfg.RESUME_FREE)
        if saved["grad_accum"] * world != self.cfg.grad_accum * W:  # another world size: same global batch only
            changed.append(f"grad_accum x ranks: {saved['grad_accum']} x {world} -> {self.cfg.grad_accum} x {W}")
        if world != W and rank["data"].get("data") is None:
            raise ConfigError(f"cannot resume {self.out / st.name} on {W} ranks (saved on {world}): the data has no "
                              "state_dict to re-shard its position (use PackedBatches) or resume on as many ranks")
        if changed:
            raise ConfigError(f"cannot resume {self.out / st.name}: TrainConfig setting(s) that change the objective "
                              f"differ from the checkpoint's ({'; '.join(changed[:4])}); resume with the same "
                              "settings or train into a new out_dir")
        st.sched.check_state(trainer["schedule"])
        if trainer["recipe"] != recipe.state_dict():
            warnings.warn(f"resuming {st.name} with other sampling settings than the checkpoint's "
                          f"({trainer['recipe']} -> {recipe.state_dict()}); the continuation is not the "
                          "run that was interrupted", stacklevel=3)
        if hasattr(self.model, "ffn_layers"):
            for f, s in zip(self.model.ffn_layers(), rank["act_sq"]):
                f.act_sq = s
        self.stream.load_state_dict(rank["data"])
        checkpoint.set_rng_state(rank["rng"])
        return int(trainer["step"]), int(trainer["tokens_seen"])

    # ---- one stage ------------------------------------------------------------------------------------
    def run_stage(self, st: _Stage, resume: bool, stop_after: int | None = None) -> bool:
        """Run (or resume) stage ``st``; returns whether the call goes on (``stop_after`` ends it early, also at the
        stage's last step: no next stage, no final model)."""
        cfg, ctx, model = self.cfg, self.ctx, self.model
        recipe = make_recipe(st.recipe_name, model, cfg, self.data, st.accum)
        opt = build_adamw(model, st.sched.peak, cfg.optim.betas, st.weight_decay, cfg.optim.eps, recipe.policy)
        step, tokens = self.restore(st, opt, recipe) if resume else (0, 0)
        if resume and ctx.is_main:
            self.log.drop_after(st.name, step)
        end = st.steps if stop_after is None else min(st.steps, stop_after)
        if step >= end:
            return step >= st.steps
        recipe.setup(model)
        model.train()
        self.log.start_stage(st.name, st.steps, step)
        params = [p for g in opt.param_groups for p in g["params"]]
        M, W, amp = st.accum, ctx.world_size, self.precision == "bf16"
        while step < end:
            t0 = time.perf_counter()
            self.watch.mark(st.name, step + 1)
            batches = [self.stream.next_on(ctx.device) for _ in range(M)]
            self._check_shape(batches[0][0])
            n_tok = dist.all_reduce(torch.stack([(b[1] != IGNORE_INDEX).sum() for b in batches]).sum().double(), ctx)
            if n_tok.item() == 0:
                raise ValueError(f"step {step}: no valid labels (all -100) in the global batch")
            n_local_tok = sum(b[0].numel() for b in batches)
            gplan = recipe.global_plan(step, tokens, M * W)
            idle = dist.teacher_padding(gplan, M, W, ctx.rank) if self.sharded else [False] * M
            scale = W / n_tok.item()
            sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)
            for r, (ids, labels, mask) in enumerate(batches):
                plan = gplan[r * W + ctx.rank]
                if self.graph_steps:
                    torch.compiler.cudagraph_mark_step_begin()
                with dist.no_sync(self.sync_mod, r < M - 1):
                    with torch.autocast(ctx.device.type, torch.bfloat16, enabled=amp):
                        if idle[r]:  # another rank's r-th micro-batch runs a teacher pass (dist.teacher_padding)
                            self.loss_mod.idle_teacher(ids, mask, cfg.loss_chunk)
                        out = self.loss_mod(ids, labels, plan.tier, plan.ffn_grad_scale, plan.distill, plan.full_ce,
                                            attention_mask=mask, chunk=cfg.loss_chunk)
                    (out[0] * scale).backward()
                if self.graph_steps and r < M - 1:  # a .grad aliases the backward graph's output, which the next
                    for p in params:                # replay overwrites before the sum (pytorch#169545): copy it
                        p.grad = None if p.grad is None else p.grad.clone()
                sums += out.detach().double()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip if cfg.optim.clip > 0 else float("inf"))
            lr = st.sched(step)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            events = recipe.after_step(step, model, opt, ctx)
            dist.all_reduce(sums, ctx)
            step_tokens = n_local_tok * W
            tokens += step_tokens
            step += 1
            loss, ce, aux, ce_full = (sums / n_tok).tolist()
            if not math.isfinite(loss):
                last = checkpoint.find_checkpoint(self.out / st.name) if ctx.is_main else "(named on rank 0)"
                kept = f"the last checkpoint is {last}" if last else "no checkpoint was written yet"
                raise FloatingPointError(
                    f"training diverged: {st.name} step {step} has a non-finite loss ({loss}); {kept}; retry with a "
                    "lower --train.optim.lr or a longer warm-up (--train.optim.warmup_frac) in a new --train.out_dir, "
                    "or check the data for bad tokens")
            dt = time.perf_counter() - t0
            rec = {"kind": "train", "stage": st.name, "step": step, "loss": loss, "ce": ce, "aux": aux, "lr": lr,
                   "tokens": tokens, "tokens_per_s": step_tokens / max(dt, 1e-9),
                   "capacities": [p.label for p in gplan],
                   "grad_norm": float(dist.full_tensor(gnorm)), **events}
            if st.name == "refine":
                rec["ce_full"] = ce_full
            saved = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step in (st.steps, end)
            self.log.train_step(rec, step % cfg.log_every == 0 or saved)   # checkpoint steps too: counts complete
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == st.steps:
                self.evaluate(st.name, step)
            if saved:
                self.save(st, step, tokens, opt, recipe)
            if self._stop_requested():
                if not saved:
                    self.log.flush(rec)
                    self.save(st, step, tokens, opt, recipe)
                raise TrainingInterrupted(self.stop.requested or "a signal on another rank", st.name, step,
                                          self.out / st.name / f"step_{step:07d}")
        self.log.close_bar()
        return step >= st.steps and step != stop_after    # stopped at its last step: the next stage waits too

    def _stop_requested(self) -> bool:
        """Whether any rank received SIGTERM/SIGINT (one tiny all-reduce per step under torchrun)."""
        if not self.ctx.distributed:
            return self.stop.requested is not None
        flag = torch.tensor([float(self.stop.requested is not None)], device=self.ctx.device)
        return bool(dist.all_reduce(flag, self.ctx).item() > 0)


def train(model_or_cfg: nn.Module | ConfigBase, data: Any, cfg: TrainConfig, val_data: Any = None,
          resume: bool | str = False, progress: bool | str = True, distributed: bool | None = None,
          stages: tuple[str, ...] | None = None, stop_after: int | None = None, overwrite: bool = False,
          record: dict[str, Any] | None = None, tokenizer: Any = None) -> TrainResult:
    """Train a model (in place; under ``parallel='fsdp'`` sharded in place: use ``TrainResult.model``) or one built
    from its config with ``cfg.seed``. ``data``: micro-batches ``(input_ids [B,T], labels [B,T])`` (labels -100
    ignored; ES-SSM classification: labels [B]; an optional third element is an attention mask), or a callable
    ``data(rank, world_size)`` returning them; ``resume``: True or ``"auto"``; ``progress``: True (bar and lines),
    ``"lines"`` or False. Every other argument: docs/training.md, the list under its ``train(...)`` signature."""
    ctx = dist.init_distributed(cfg.device, distributed, cfg.dist_timeout_s)
    lock, trainer = None, None
    try:
        from ..models import build_model  # ESSH, ES-SSM, Transformer++ or MatFormer by the config's arch

        model = model_or_cfg if isinstance(model_or_cfg, nn.Module) else build_model(model_or_cfg, cfg.seed)
        model = model.to(ctx.device)
        if tokenizer is not None:
            from ..data import load_tokenizer

            model.tokenizer = load_tokenizer(tokenizer)
        recipe = resolve_recipe_name(cfg.recipe, model)
        lock, resume = start_run(model, cfg, ctx, resume, overwrite, record)
        mode = {} if cfg.compile_mode == "default" else {"mode": cfg.compile_mode}   # torch.compile's own default
        if cfg.compile and cfg.compile_scope == "model":
            from ..models import compile_model

            compile_model(model, **mode)
        elif cfg.compile:                    # each block; one compile per sampled capacity (the limit covers them)
            from ..models.compile import prepare_dynamo

            prepare_dynamo(max(8, 2 * len(cfg.mixing.capacities) + 4))
            for block in getattr(model, "blocks", []):
                block.compile(**mode)
        with StopSignals(announce=ctx.is_main) as stop:
            trainer = _Trainer(model, data, cfg, ctx, val_data, progress, stop)
            finished = True
            try:
                for st in _stages(cfg, recipe, stages, ctx.world_size):
                    finished = trainer.run_stage(st, resume, stop_after)
                    if not finished:
                        break
            finally:  # an error message then starts on a line of its own
                trainer.log.close()
                trainer.watch.close()
            # the final save runs under the same handlers: a SIGTERM / Ctrl-C now lets it finish (a half-written
            # final/ and a silent exit would leave a finished run looking unfinished)
            path = None
            if dist.is_sharded(model):
                state = checkpoint.full_model_state(model)
                if ctx.is_main:
                    model = dist.unsharded_copy(model, state, ctx.device)
            if finished and ctx.is_main:
                path = model.save_pretrained(Path(cfg.out_dir) / "final")
            if finished and stop.requested and ctx.is_main:
                print(f"[train] {stop.requested} arrived during the final save; the save finished and the run is "
                      f"complete ({path})", flush=True)
        return TrainResult(trainer.log.history, path, model, trainer.log.evals)
    except TrainingInterrupted:  # every rank stops after the same step: the usual clean close
        raise
    except OSError as e:         # a full disk or quota during a write: say what is kept and how to go on
        import errno

        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or e.filename is None:
            raise
        found = [c for c in (checkpoint.find_checkpoint(Path(cfg.out_dir) / s) for s in ("refine", "pretrain")) if c]
        kept = (f"the last complete checkpoint is {found[0]}: free space, then continue with --resume" if found
                else "no checkpoint was written yet: free space, then start again (--resume auto)")
        raise type(e)(e.errno, f"{e.strerror}; {kept}", e.filename) from e
    except Exception as e:  # a failed collective: one line naming this rank and its step
        ctx.close(clean=False)  # no final barrier: the peers may never come to it
        err = dist.collective_error(e, ctx, trainer and trainer.watch.where, cfg.dist_timeout_s)
        if err is e:
            raise
        raise err from e
    finally:
        if lock is not None:
            lock.release()
        ctx.close()


def refine(model: nn.Module, data: Any, cfg: TrainConfig, **kw: Any) -> TrainResult:
    """Shared refinement (ESSH D.8) of a pretrained ESSH as a separate stage (``cfg.refine`` settings)."""
    return train(model, data, cfg, stages=("refine",), **kw)
