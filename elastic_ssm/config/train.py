"""``TrainConfig``: one training run (batch shape, precision, placement) with its recipe knobs in sections
(``recipe.py``): a run file writes ``train: {steps: 300, optim: {lr: 3e-3}}``, the CLI ``--train.optim.lr 3e-3``.
The flat names of earlier versions (``lr``) are unknown keys; only a saved record of an old run is mapped to the
sections (``upgrade_record``), so it still resumes. ``preset("370m" | "1.5b")``: the papers' setting (Table 7,
Table 55, D.8); the global batch is in tokens and ``micro_batches(world_size)`` splits it over the ranks (E.2)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import StringConstraints

from .base import AtLeast1, ConfigBase, ConfigError, Distinct, NonEmpty, NonNeg, Pos, Seed, opt, section
from .recipe import (
    REFINE_CAPACITIES,
    T1_T9,
    BudgetDropoutConfig,
    CheckpointConfig,
    EvalConfig,
    MixingConfig,
    OptimConfig,
    OrderingConfig,
    RefineConfig,
)

__all__ = ["TrainConfig", "TRAIN_PRESETS", "resolve_precision"]

Recipe = Literal["auto", "capacity_mixed", "budget_dropout", "nested_ffn", "posthoc", "dense"]
Parallel = Literal["ddp", "fsdp"]
Precision = Literal["auto", "fp32", "bf16"]
#: the loggers ``log`` may name beside metrics.jsonl (``train/metrics.py``)
LogSink = Literal["csv", "tensorboard", "wandb"]
CompileScope = Literal["blocks", "model"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
Device = Annotated[str, StringConstraints(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")]   # 'cuda:<i>' too
LOG_SINKS = get_args(LogSink)
#: most tokens one rank may read for one optimizer step (2^31, ~4,000x Table 7's 1.5B batch): above it a step
#: would take days, and a flag typo (``--train.grad_accum 1000000000``) would look like a hang
MAX_STEP_TOKENS = 1 << 31

#: The papers' training settings per ESSH model size (Table 7, Table 55, D.4, D.8, E.3). Steps are the
#: pretraining tokens over the tokens per step (370M: 7.4B / 262,144; 1.5B: 100B / 524,288). The 1.5B
#: micro-batches, 8 x 2048 (370M) and 4 x 2048 (1.5B) tokens, are the B that Table 50 lists for its runs.
TRAIN_PRESETS: dict[str, dict] = {
    "370m": dict(recipe="capacity_mixed", steps=28229, micro_batch_size=8, seq_len=2048, tokens_per_step=262_144,
                 optim=dict(lr=1.2e-3), mixing=dict(n_warm_tokens=250_000_000), eval=dict(every=500),
                 checkpoint=dict(every=250),
                 refine=dict(steps=2060, tokens_per_step=131_072, lr=6e-5, capacities=REFINE_CAPACITIES,
                             capacity_mode="per_step")),
    "1.5b": dict(recipe="capacity_mixed", steps=190_735, micro_batch_size=4, seq_len=2048, tokens_per_step=524_288,
                 optim=dict(lr=1.0e-3), mixing=dict(n_warm_tokens=250_000_000), eval=dict(every=1000),
                 checkpoint=dict(every=200),
                 refine=dict(steps=4120, tokens_per_step=131_072, lr=6e-5, capacities=T1_T9, capacity_mode="cycle")),
}

_SECTIONS = {"optim": ("lr", "warmup_frac", "min_lr_frac", "betas", "eps", "weight_decay", "clip"),
             "mixing": ("n_warm_tokens", "full_share", "capacities", "kl_coef", "alpha_ff")}
#: the flat names of the train records of earlier versions -> their section paths (``upgrade_record``)
RECORD_RENAMES = {**{n: f"{s}.{n}" for s, names in _SECTIONS.items() for n in names},
         "order_every": "ordering.every", "order_until": "ordering.until", "stat_decay": "ordering.stat_decay",
         "bd_warmup_steps": "budget_dropout.warmup_steps", "bd_warmup_epochs": "budget_dropout.warmup_epochs",
         "bd_warmup_frac": "budget_dropout.warmup_frac", "n_full": "budget_dropout.n_full",
         "eval_every": "eval.every", "eval_batches": "eval.batches", "eval_tiers": "eval.tiers",
         "bytes_per_token": "eval.bytes_per_token", "checkpoint_every": "checkpoint.every",
         "keep_last": "checkpoint.keep_last"}


def resolve_precision(precision: str, device: object) -> str:
    """``'auto'`` -> ``'bf16'`` on CUDA (bf16 autocast, ESSH E.5 / Table 7), ``'fp32'`` elsewhere; an explicit
    ``'fp32'`` / ``'bf16'`` is kept. ``device`` is a ``torch.device`` or a device string."""
    return precision if precision != "auto" else "bf16" if str(device).startswith("cuda") else "fp32"


@dataclass(kw_only=True)
class TrainConfig(ConfigBase):
    """One training run: recipe, batch shape, precision and placement; the recipe knobs in sections."""

    #: settings a resumed run may change: logging, evaluation, checkpoint cadence, placement and compilation
    #: (every other setting changes the objective, the data order or the schedule, so ``resume`` refuses it);
    #: ``grad_accum`` may change only with the world size, keeping ``grad_accum x ranks`` (checked on resume)
    RESUME_FREE: ClassVar[frozenset[str]] = frozenset({"grad_accum", "out_dir", "log_every", "log", "eval",
        "checkpoint", "compile", "compile_scope", "compile_mode", "device", "parallel", "loss_chunk", "dist_timeout_s"})

    recipe: Recipe = opt("auto", "'capacity_mixed' (ESSH, Alg. 1), 'budget_dropout' (ES-SSM, Sec. 4.2), "
                      "'nested_ffn' (MatFormer, N.1), 'posthoc' (recovery of a dense parent, E.7: `elastic-ssm "
                      "recover`), 'dense' (full capacity only) or 'auto' (by model type)")
    steps: AtLeast1 = opt(1000, "optimizer steps of the pretraining stage (CPU default; paper 370M: 7.4B tokens / "
                               "262,144 = 28,229)")
    micro_batch_size: AtLeast1 = opt(8, "sequences per micro-batch on each rank (B); the data must deliver it")
    grad_accum: AtLeast1 = opt(1, "micro-batches per optimizer step on each rank (M; global M = M x world); "
                          "with tokens_per_step > 0 it is derived and must stay 1")
    tokens_per_step: NonNeg = opt(0, "global batch in tokens per optimizer step (Table 7: 262,144 at 370M, 524,288 "
                               "at 1.5B); > 0 derives M = tokens_per_step / (micro_batch_size x seq_len x ranks); "
                               "0: M = grad_accum")
    seq_len: AtLeast1 = opt(512, "tokens per sequence (L; paper: 2048); the data must deliver it")
    optim: OptimConfig = section(OptimConfig, "AdamW and the warm-up + cosine schedule (Table 7)")
    mixing: MixingConfig = section(MixingConfig, "capacity-mixed training (ESSH Alg. 1, D.4)")
    ordering: OrderingConfig = section(OrderingConfig, "FFN importance ordering (ESSH D.3)")
    budget_dropout: BudgetDropoutConfig = section(BudgetDropoutConfig, "ES-SSM budget dropout (Alg. 2)")
    refine: RefineConfig = section(RefineConfig, "shared-refinement stage after pretraining (D.8)")
    eval: EvalConfig = section(EvalConfig, "validation during training (E.4)")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoint cadence and retention")
    loss_chunk: NonNeg = opt(0, "chunked loss (D.6): positions per chunk, 0 = full-logit loss (paper: 4096 when "
                                "enabled; its main 370M run and SR use the full-logit loss)")
    precision: Precision = opt("auto", "'auto' (bf16 on CUDA, fp32 on CPU), 'fp32' or 'bf16' (autocast with fp32 "
                         "master weights, E.5)")
    out_dir: NonEmpty = opt("runs/train", "run directory: checkpoints, metrics.jsonl, final model")
    seed: Seed = opt(0, "seed of model init, capacity sampling and budget sampling (a 64-bit unsigned integer)")
    log_every: AtLeast1 = opt(10, "write a metrics.jsonl training record every this many steps")
    log: Annotated[tuple[LogSink, ...], Distinct] = opt((), "loggers beside metrics.jsonl (the record of truth): "
                                                        "any of 'csv' (metrics.csv), 'tensorboard', 'wandb' (extra "
                                                        "'log'; WANDB_MODE=offline works); train/metrics.py")
    compile: bool = opt(False, "torch.compile the model (scope: compile_scope; one compile per sampled capacity, "
                        "absorbed by the first steps)")
    compile_scope: CompileScope = opt("blocks", "with compile: 'blocks' (each block, one graph per block kind and "
                             "capacity: short compiles for capacity-mixed training, works with FSDP) or 'model' "
                             "(elastic_ssm.compile_model: embedding, blocks, norm and logits in one graph per "
                             "capacity: fewer kernels, longer compiles; not with parallel='fsdp')")
    compile_mode: CompileMode = opt("default", "with compile: torch.compile's mode; 'reduce-overhead' replays each "
                                    "graph from CUDA graphs (for small models whose step is bound by kernel "
                                    "launches, e.g. MQAR's; CUDA only)")
    device: Device = opt("auto", "'auto' (cuda:LOCAL_RANK if available, else cpu; never mps: no float64), "
                                 "'cpu' or 'cuda'")
    parallel: Parallel = opt("ddp", "'ddp' or 'fsdp' (FSDP2 fully_shard per block, for models that need sharding); "
                        "used under torchrun with more than one rank")
    dist_timeout_s: Pos = opt(600.0, "under torchrun: seconds a collective may wait for the other ranks before "
                                "the run stops with an error naming the rank and the step (a stuck or diverged "
                                "rank; raise it when one rank alone does long work such as a big checkpoint)")

    def validate(self) -> None:
        if self.tokens_per_step and self.grad_accum != 1:
            raise ConfigError(f"TrainConfig.grad_accum: is derived from tokens_per_step={self.tokens_per_step:,} (the "
                              "global batch in tokens); give one of them (set tokens_per_step 0 to use grad_accum)")
        for stage in ("pretrain", "refine"):
            tokens = self.micro_batch_size * self.seq_len * self.micro_batches(1, stage)   # whole micro-batches
            if tokens > MAX_STEP_TOKENS:
                raise ConfigError(f"TrainConfig: one {stage} optimizer step would read {tokens:,} tokens "
                                  f"(micro_batch_size x seq_len x micro-batches), more than {MAX_STEP_TOKENS:,}; "
                                  "lower grad_accum, tokens_per_step, micro_batch_size or seq_len")
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(f"TrainConfig.compile_mode: {self.compile_mode!r} takes effect only with compile; "
                              "add --train.compile (or leave compile_mode at 'default')")
        if self.compile and self.compile_scope == "model" and self.parallel == "fsdp":
            raise ConfigError("TrainConfig.compile_scope: 'model' does not combine with parallel='fsdp' (FSDP2 "
                              "shards per block); use compile_scope='blocks'")

    @property
    def warmup_steps(self) -> int:
        """LR warm-up length in steps: ``round(optim.warmup_frac * steps)``."""
        return round(self.optim.warmup_frac * self.steps)

    def micro_batches(self, world_size: int = 1, stage: str = "pretrain") -> int:
        """Micro-batches per rank and optimizer step (M) of ``stage`` ('pretrain' or 'refine') on ``world_size``
        ranks: ``tokens_per_step / (micro_batch_size x seq_len x world_size)`` when the batch is stated in
        tokens, else ``grad_accum``; a token batch the ranks cannot split evenly is a ConfigError."""
        own = stage == "refine" and self.refine.tokens_per_step      # refinement's own batch, else pretraining's
        name, tokens = ("refine.tokens_per_step", own) if own else ("tokens_per_step", self.tokens_per_step)
        if not tokens:
            return self.grad_accum
        B, T = self.micro_batch_size, self.seq_len
        per = B * T * world_size
        if tokens % per:
            raise ConfigError(f"TrainConfig.{name}={tokens:,} is not a multiple of micro_batch_size x seq_len x "
                              f"ranks = {B} x {T} x {world_size} = {per:,}; change {name}, micro_batch_size or the "
                              "number of ranks")
        return tokens // per

    @classmethod
    def upgrade_record(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A ``train`` record (``to_dict()``) written by an earlier version, with its flat names
        (``RECORD_RENAMES``) moved into their sections (for the resume of an old ``run.yaml`` or checkpoint)."""
        if not isinstance(d, dict):
            return d
        out = {k: v for k, v in d.items() if k not in RECORD_RENAMES}
        for old in RECORD_RENAMES.keys() & d.keys():
            sec, sub = RECORD_RENAMES[old].split(".")
            out[sec] = {**(out.get(sec) or {}), sub: d[old]}
        return out

    @classmethod
    def suggest(cls, key: str) -> str:
        """The section path of an old flat name (``lr`` -> ``optim.lr``), else the closest path."""
        return f"; did you mean {RECORD_RENAMES[key]}?" if key in RECORD_RENAMES else super().suggest(key)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TrainConfig:
        """The paper's training setting of model size ``name`` (``TRAIN_PRESETS``) with ``overrides``; a section
        in ``overrides`` (a mapping or a config) updates the preset's section field by field."""
        if name not in TRAIN_PRESETS:
            raise ConfigError(f"unknown training preset {name!r}; choose one of {sorted(TRAIN_PRESETS)}")
        base = dict(TRAIN_PRESETS[name])
        for sec in _SECTION_NAMES & set(overrides):      # a mapping updates the preset's section; a config replaces it
            given = overrides.pop(sec)
            base[sec] = {**base.get(sec, {}), **given} if isinstance(given, dict) else given
        return cls(**{**base, **overrides})


_SECTION_NAMES = frozenset(f.name for f in dataclasses.fields(TrainConfig)
                           if isinstance(f.default_factory, type) and issubclass(f.default_factory, ConfigBase))
