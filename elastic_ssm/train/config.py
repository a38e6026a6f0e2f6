"""Training configuration: ``TrainConfig`` and its nested ``RefineConfig`` (ConfigBase style).

Defaults are the paper's constants (ESSH Table 7 / Table 55, Appendices D.3-D.8; ES-SSM Sec. 4.2)
except where a CPU default is stated in the help text (``steps``, batch shape, ``n_warm_tokens``,
``out_dir``). Every field has a ``help`` string; the CLI derives its flags from these dataclasses and a
``train:`` section of a run YAML loads into ``TrainConfig.from_dict``.

``TrainConfig.preset("370m" | "1.5b")`` holds the paper's whole training setting of a model size (Table 7,
Table 55, D.8): batch in tokens, peak lr, token warm-up, cadences and the shared-refinement stage; a run
file says ``train: {preset: 1.5b, ...}`` and its other keys override the preset's. The global batch is
stated in tokens (``tokens_per_step``) and ``micro_batches(world_size)`` derives the micro-batches per
rank from the number of ranks (E.2: "distributed training preserves the stated global token batch").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config import ESSH_TIER_XI, ConfigBase, ConfigError, opt

__all__ = ["TrainConfig", "RefineConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "RECIPES", "PARALLEL",
           "TRAIN_PRESETS", "PRECISIONS", "resolve_precision"]

#: The ten pretraining capacities xi of ESSH D.4 / Table 55 (full capacity included).
TRAIN_CAPACITIES = (1 / 16, 3 / 32, 1 / 8, 5 / 32, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
#: Shared-refinement capacities of the 370M run, {2, 4, 8, 16, 24} / 32 (D.8, Table 55).
REFINE_CAPACITIES = tuple(n / 32 for n in (2, 4, 8, 16, 24))
RECIPES = ("auto", "capacity_mixed", "budget_dropout", "nested_ffn", "posthoc", "dense")
PARALLEL = ("ddp", "fsdp")
PRECISIONS = ("auto", "fp32", "bf16")
#: T1-T9 of the deployment tiers, {2,4,7,10,13,17,20,24,28}/32 (D.1): the 1.5B refinement capacities (D.8).
_T1_T9 = ESSH_TIER_XI[:-1]

#: The papers' training settings per ESSH model size (Table 7, Table 55, D.4, D.8, E.3). Steps are the
#: pretraining tokens over the tokens per step (370M: 7.4B / 262,144; 1.5B: 100B / 524,288). The 1.5B
#: micro-batch of 4 x 2048 tokens is inferred from D.8 (131,072 refinement tokens in 16 micro-batches).
TRAIN_PRESETS: dict[str, dict] = {
    "370m": dict(recipe="capacity_mixed", steps=28229, micro_batch_size=8, seq_len=2048, tokens_per_step=262_144,
                 lr=1.2e-3, n_warm_tokens=250_000_000, eval_every=500, checkpoint_every=250,
                 refine=dict(steps=2060, tokens_per_step=131_072, lr=6e-5, capacities=REFINE_CAPACITIES,
                             capacity_mode="per_step")),
    "1.5b": dict(recipe="capacity_mixed", steps=190_735, micro_batch_size=4, seq_len=2048, tokens_per_step=524_288,
                 lr=1.0e-3, n_warm_tokens=250_000_000, eval_every=1000, checkpoint_every=200,
                 refine=dict(steps=4120, tokens_per_step=131_072, lr=6e-5, capacities=_T1_T9,
                             capacity_mode="cycle")),
}


def resolve_precision(precision: str, device: object) -> str:
    """``'auto'`` -> ``'bf16'`` on CUDA (bf16 autocast, ESSH E.5 / Table 7), ``'fp32'`` elsewhere; an explicit
    ``'fp32'`` / ``'bf16'`` is kept. ``device`` is a ``torch.device`` or a device string."""
    if precision != "auto":
        return precision
    return "bf16" if str(device).startswith("cuda") else "fp32"


def _micro_batches(tokens: int, B: int, T: int, world: int, name: str) -> int:
    per = B * T * world
    if tokens % per:
        raise ConfigError(f"TrainConfig.{name}={tokens:,} is not a multiple of micro_batch_size x seq_len x ranks = "
                          f"{B} x {T} x {world} = {per:,}; change {name}, micro_batch_size or the number of ranks")
    return tokens // per


def _check(cond: bool, cls: str, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{cls}.{name} {msg}")


def _check_fracs(values: tuple[float, ...], cls: str, name: str) -> None:
    _check(len(values) > 0 and all(0 < x <= 1 for x in values), cls, name,
           f"must be a non-empty list of capacity fractions in (0, 1], got {values}")


@dataclass(kw_only=True)
class RefineConfig(ConfigBase):
    """Shared refinement (SR), ESSH Appendix D.8: L = CE(p_full) + CE(p_T) + tv_coef TV(sg[p_full], p_T)."""

    steps: int = opt(0, "SR optimizer steps after pretraining (0: no SR stage; paper 370M: 2060, 1.5B: 4120)")
    tokens_per_step: int = opt(0, "SR global batch in tokens, independent of pretraining (Table 55: 131,072); "
                               "0: the pretraining batch. Micro-batches keep micro_batch_size x seq_len")
    lr: float = opt(6e-5, "SR peak learning rate (Table 55: 6e-5)")
    tv_coef: float = opt(5.0, "coefficient of the total-variation distillation term (D.8: 5)")
    capacities: tuple[float, ...] = opt(REFINE_CAPACITIES, "SR capacity fractions ({2,4,8,16,24}/32 at 370M)")
    capacity_mode: str = opt("per_step", "'per_step': one capacity per step for all its micro-batches (370M);"
                             " 'cycle': shuffle the capacities each step and cycle over micro-batches (1.5B)")
    warmup_frac: float = opt(0.05, "SR linear warm-up as a fraction of SR steps (D.8: 0.05)")
    min_lr_frac: float = opt(0.0, "SR cosine floor as a fraction of the SR peak (D.8: decay toward zero)")
    weight_decay: float = opt(0.1, "SR AdamW weight decay on every tensor with >= 2 dims (D.8: 0.1)")
    alpha_ff: float = opt(0.5, "retained-FFN gradient scale of the reduced branch during SR (D.8: 0.5)")

    def validate(self) -> None:
        c = "RefineConfig"
        _check(self.steps >= 0, c, "steps", f"must be >= 0, got {self.steps}")
        _check(self.tokens_per_step >= 0, c, "tokens_per_step", f"must be >= 0, got {self.tokens_per_step}")
        _check(self.lr > 0, c, "lr", f"must be > 0, got {self.lr}")
        _check(self.tv_coef >= 0, c, "tv_coef", f"must be >= 0, got {self.tv_coef}")
        _check_fracs(self.capacities, c, "capacities")
        _check(self.capacity_mode in ("per_step", "cycle"), c, "capacity_mode",
               f"must be 'per_step' or 'cycle', got {self.capacity_mode!r}")
        _check(0 <= self.warmup_frac < 1, c, "warmup_frac", f"must lie in [0, 1), got {self.warmup_frac}")
        _check(0 <= self.min_lr_frac <= 1, c, "min_lr_frac", f"must lie in [0, 1], got {self.min_lr_frac}")
        _check(self.weight_decay >= 0, c, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(0 < self.alpha_ff <= 1, c, "alpha_ff", f"must lie in (0, 1], got {self.alpha_ff}")


@dataclass(kw_only=True)
class TrainConfig(ConfigBase):
    """One training run: recipe, batch shape, AdamW + schedule, elastic knobs, eval, checkpoints."""

    #: fields a resumed run may change: logging, evaluation, checkpoint cadence, placement and compilation
    #: (every other field changes the objective, the data order or the schedule, so ``resume`` refuses it);
    #: ``grad_accum`` may change only with the world size, keeping ``grad_accum x ranks`` (checked on resume)
    RESUME_FREE: ClassVar[frozenset[str]] = frozenset({"grad_accum",
        "out_dir", "log_every", "eval_every", "eval_batches", "eval_tiers", "bytes_per_token", "checkpoint_every",
        "keep_last", "compile", "compile_scope", "device", "parallel", "loss_chunk", "dist_timeout_s"})

    recipe: str = opt("auto", "'capacity_mixed' (ESSH, Alg. 1), 'budget_dropout' (ES-SSM, Sec. 4.2), "
                      "'nested_ffn' (MatFormer, N.1), 'posthoc' (recovery of a dense parent, E.7: `elastic-ssm "
                      "recover`), 'dense' (full capacity only) or 'auto' (by model type)")
    steps: int = opt(1000, "optimizer steps of the pretraining stage (CPU default; paper 370M: 28,229)")
    micro_batch_size: int = opt(8, "sequences per micro-batch on each rank (B); the data must deliver it")
    grad_accum: int = opt(1, "micro-batches per optimizer step on each rank (M; global M = M x world); "
                          "with tokens_per_step > 0 it is derived and must stay 1")
    tokens_per_step: int = opt(0, "global batch in tokens per optimizer step (Table 7: 262,144 at 370M, 524,288 "
                               "at 1.5B); > 0 derives M = tokens_per_step / (micro_batch_size x seq_len x ranks); "
                               "0: M = grad_accum")
    seq_len: int = opt(512, "tokens per sequence (L; paper: 2048); the data must deliver it")
    lr: float = opt(1.2e-3, "peak learning rate (Table 7, 370M: 1.2e-3; 1.5B: 1.0e-3)")
    warmup_frac: float = opt(0.01, "linear LR warm-up as a fraction of steps (Table 7: 0.01)")
    min_lr_frac: float = opt(0.1, "cosine floor as a fraction of the peak LR (Table 7: 0.1)")
    betas: tuple[float, ...] = opt((0.9, 0.95), "AdamW (beta1, beta2) (Table 7)")
    eps: float = opt(1e-8, "AdamW epsilon (paper silent; torch default)")
    weight_decay: float = opt(0.1, "AdamW weight decay of the decayed group (Table 7: 0.1; groups: E.2)")
    clip: float = opt(1.0, "global gradient-norm clip (Table 7: 1.0; 0 disables)")
    n_warm_tokens: int = opt(200_000, "tokens trained at full capacity before capacity mixing "
                             "(D.4; paper 250M, CPU default 200k)")
    full_share: float = opt(0.75, "fraction f of each step's micro-batches reserved for full capacity (D.4)")
    capacities: tuple[float, ...] = opt(TRAIN_CAPACITIES, "training capacity fractions xi drawn uniformly by "
                                        "the non-reserved micro-batches (D.4, full included)")
    kl_coef: float = opt(0.5, "coefficient of KL(sg[p_full] || p_T) on reduced micro-batches (Eq. 8)")
    alpha_ff: float = opt(0.5, "FFN weight-gradient scale on reduced micro-batches (D.4)")
    order_every: int = opt(500, "FFN importance ordering period in steps (D.3; 0 disables)")
    order_until: float = opt(0.8, "ordering happens only while step < order_until x steps (D.3: 0.8)")
    stat_decay: float = opt(0.99, "decay of the running mean of squared FFN activations (paper silent)")
    refine: RefineConfig = field(default_factory=RefineConfig,
                                 metadata={"help": "shared-refinement stage after pretraining (D.8)"})
    bd_warmup_steps: int = opt(0, "budget dropout: steps at the full budget before sampling (ES-SSM Alg. 2); "
                               "> 0 overrides bd_warmup_frac")
    bd_warmup_epochs: float = opt(0.0, "budget dropout warm-up in epochs (E_warmup); overrides "
                                  "bd_warmup_steps when > 0 and needs data with len() (batches per epoch)")
    bd_warmup_frac: float = opt(0.1, "budget dropout warm-up as a fraction of steps when bd_warmup_steps and "
                                "bd_warmup_epochs are 0 (Alg. 2's first phase is on by default; the paper's "
                                "E_warmup is not in its text, 0.1 is our choice; 0 disables the warm-up)")
    n_full: int = opt(8, "budget dropout: a full-budget anchor on every n_full-th step after warm-up")
    loss_chunk: int = opt(0, "chunked loss (D.6): positions per chunk, 0 = full-logit loss (paper: 4096)")
    precision: str = opt("auto", "'auto' (bf16 on CUDA, fp32 on CPU), 'fp32' or 'bf16' (autocast with fp32 "
                         "master weights, E.5)")
    eval_every: int = opt(500, "validate every this many steps (Table 7: 500; 0: only at the end)")
    eval_batches: int = opt(16, "validation batches per tier (E.4: 16 batches of 8 x 2048)")
    eval_tiers: tuple[str, ...] = opt((), "tiers to validate ('T4', 'K8', ...); empty: every deployment tier")
    bytes_per_token: float = opt(0.0, "bytes per token for bits-per-byte; 0: 1 for a 260-entry byte "
                                 "vocabulary, otherwise only bits-per-token are reported")
    checkpoint_every: int = opt(250, "checkpoint every this many steps (Table 7: 250; 0: only at the end)")
    keep_last: int = opt(3, "checkpoints kept per stage (older ones are deleted)")
    out_dir: str = opt("runs/train", "run directory: checkpoints, metrics.jsonl, final model")
    seed: int = opt(0, "seed of model init, capacity sampling and budget sampling")
    log_every: int = opt(10, "write a metrics.jsonl training record every this many steps")
    compile: bool = opt(False, "torch.compile the model (scope: compile_scope; one compile per sampled capacity, "
                        "absorbed by the first steps)")
    compile_scope: str = opt("blocks", "with compile: 'blocks' (each block, one graph per block kind and "
                             "capacity: short compiles for capacity-mixed training, works with FSDP) or 'model' "
                             "(elastic_ssm.compile_model: embedding, blocks, norm and logits in one graph per "
                             "capacity: fewer kernels, longer compiles; not with parallel='fsdp')")
    device: str = opt("auto", "'auto' (cuda:LOCAL_RANK if available, else cpu), 'cpu' or 'cuda'")
    parallel: str = opt("ddp", "'ddp' or 'fsdp' (FSDP2 fully_shard per block, for models that need sharding); "
                        "used under torchrun with more than one rank")
    dist_timeout_s: float = opt(600.0, "under torchrun: seconds a collective may wait for the other ranks before "
                                "the run stops with an error naming the rank and the step (a stuck or diverged "
                                "rank; raise it when one rank alone does long work such as a big checkpoint)")

    def validate(self) -> None:
        c = "TrainConfig"
        _check(self.recipe in RECIPES, c, "recipe", f"must be one of {RECIPES}, got {self.recipe!r}")
        for name in ("steps", "micro_batch_size", "grad_accum", "seq_len", "eval_batches", "keep_last",
                     "log_every"):
            _check(getattr(self, name) >= 1, c, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("n_warm_tokens", "order_every", "bd_warmup_steps", "n_full", "loss_chunk", "tokens_per_step",
                     "eval_every", "checkpoint_every", "seed"):
            _check(getattr(self, name) >= 0, c, name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.lr > 0, c, "lr", f"must be > 0, got {self.lr}")
        _check(0 <= self.warmup_frac < 1, c, "warmup_frac", f"must lie in [0, 1), got {self.warmup_frac}")
        _check(0 <= self.min_lr_frac <= 1, c, "min_lr_frac", f"must lie in [0, 1], got {self.min_lr_frac}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), c, "betas",
               f"must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps > 0, c, "eps", f"must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, c, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.clip >= 0, c, "clip", f"must be >= 0 (0 disables clipping), got {self.clip}")
        _check(0 <= self.full_share <= 1, c, "full_share", f"must lie in [0, 1], got {self.full_share}")
        _check_fracs(self.capacities, c, "capacities")
        _check(self.kl_coef >= 0, c, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(0 < self.alpha_ff <= 1, c, "alpha_ff", f"must lie in (0, 1], got {self.alpha_ff}")
        _check(0 <= self.order_until <= 1, c, "order_until", f"must lie in [0, 1], got {self.order_until}")
        _check(0 <= self.stat_decay < 1, c, "stat_decay", f"must lie in [0, 1), got {self.stat_decay}")
        _check(self.bd_warmup_epochs >= 0, c, "bd_warmup_epochs",
               f"must be >= 0, got {self.bd_warmup_epochs}")
        _check(0 <= self.bd_warmup_frac < 1, c, "bd_warmup_frac", f"must lie in [0, 1), got {self.bd_warmup_frac}")
        _check(self.precision in PRECISIONS, c, "precision",
               f"must be one of {PRECISIONS}, got {self.precision!r}")
        _check(self.tokens_per_step == 0 or self.grad_accum == 1, c, "grad_accum",
               f"is derived from tokens_per_step={self.tokens_per_step:,} (the global batch in tokens); give one of "
               "them (set tokens_per_step 0 to use grad_accum)")
        if self.tokens_per_step:
            _micro_batches(self.tokens_per_step, self.micro_batch_size, self.seq_len, 1, "tokens_per_step")
        if self.refine.tokens_per_step:
            _micro_batches(self.refine.tokens_per_step, self.micro_batch_size, self.seq_len, 1,
                           "refine.tokens_per_step")
        _check(self.bytes_per_token >= 0, c, "bytes_per_token", f"must be >= 0, got {self.bytes_per_token}")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), c, "device",
               f"must be 'auto', 'cpu', 'cuda' or 'cuda:<i>', got {self.device!r}")
        _check(self.parallel in PARALLEL, c, "parallel", f"must be one of {PARALLEL}, got {self.parallel!r}")
        _check(self.compile_scope in ("blocks", "model"), c, "compile_scope",
               f"must be 'blocks' or 'model', got {self.compile_scope!r}")
        _check(not (self.compile and self.compile_scope == "model" and self.parallel == "fsdp"), c,
               "compile_scope", "'model' does not combine with parallel='fsdp' (FSDP2 shards per block); "
               "use compile_scope='blocks'")
        _check(self.dist_timeout_s > 0, c, "dist_timeout_s", f"must be > 0 seconds, got {self.dist_timeout_s}")
        _check(bool(self.out_dir), c, "out_dir", "must be a directory path")

    @property
    def warmup_steps(self) -> int:
        """LR warm-up length in steps: ``round(warmup_frac * steps)``."""
        return round(self.warmup_frac * self.steps)

    def micro_batches(self, world_size: int = 1, stage: str = "pretrain") -> int:
        """Micro-batches per rank and optimizer step (M) of ``stage`` ('pretrain' or 'refine') on ``world_size``
        ranks: ``tokens_per_step / (micro_batch_size x seq_len x world_size)`` when the batch is stated in
        tokens, else ``grad_accum``; a token batch the ranks cannot split evenly is a ConfigError."""
        if stage == "refine" and self.refine.tokens_per_step:
            return _micro_batches(self.refine.tokens_per_step, self.micro_batch_size, self.seq_len, world_size,
                                  "refine.tokens_per_step")
        if self.tokens_per_step:
            return _micro_batches(self.tokens_per_step, self.micro_batch_size, self.seq_len, world_size,
                                  "tokens_per_step")
        return self.grad_accum

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TrainConfig:
        """The paper's training setting of model size ``name`` (``TRAIN_PRESETS``) with ``overrides``; a
        ``refine`` mapping in ``overrides`` updates the preset's refinement fields one by one."""
        if name not in TRAIN_PRESETS:
            raise ConfigError(f"unknown training preset {name!r}; choose one of {sorted(TRAIN_PRESETS)}")
        base = dict(TRAIN_PRESETS[name])
        refine = overrides.pop("refine", None)
        if isinstance(refine, RefineConfig):
            refine = refine.to_dict()
        if refine is not None and not isinstance(refine, dict):
            raise ConfigError(f"TrainConfig.refine: expected a mapping of RefineConfig fields, got {refine!r}")
        base["refine"] = RefineConfig.from_dict({**base["refine"], **(refine or {})})
        return cls(**{**base, **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """``ConfigBase.from_dict`` plus an optional ``preset`` key (``TrainConfig.preset``)."""
        if isinstance(d, dict) and "preset" in d:
            d = dict(d)
            name = d.pop("preset")
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(d) - names)
            if unknown:
                raise ConfigError(f"TrainConfig: unknown field(s) {unknown} beside preset {name!r}; valid fields are "
                                  f"{sorted(names)}")
            return cls.preset(name, **d)
        return super().from_dict(d)
