"""The sections of ``TrainConfig``: optimizer, capacity mixing, FFN ordering, budget dropout, evaluation,
checkpoints and shared refinement (ESSH Table 7 / Table 55, Appendices D.3-D.8; ES-SSM Sec. 4.2).

Defaults are the papers' constants except where the help text states a CPU default (``n_warm_tokens``).
Each section is a ``ConfigBase``, so a run file writes ``train: {optim: {lr: 1e-3}, mixing: {kl_coef: 0.5}}``
and the CLI takes ``--train.optim.lr 1e-3``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigBase, check, opt
from .essh import ESSH_TIER_XI

__all__ = ["OptimConfig", "MixingConfig", "OrderingConfig", "BudgetDropoutConfig", "EvalConfig",
           "CheckpointConfig", "RefineConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "T1_T9"]

#: The ten pretraining capacities xi of ESSH D.4 / Table 55 (full capacity included).
TRAIN_CAPACITIES = (1 / 16, 3 / 32, 1 / 8, 5 / 32, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
#: Shared-refinement capacities of the 370M run, {2, 4, 8, 16, 24} / 32 (D.8, Table 55).
REFINE_CAPACITIES = tuple(n / 32 for n in (2, 4, 8, 16, 24))
#: T1-T9 of the deployment tiers, {2,4,7,10,13,17,20,24,28}/32 (D.1): the 1.5B refinement capacities (D.8).
T1_T9 = ESSH_TIER_XI[:-1]


def check_fracs(values: tuple[float, ...], cls: str, name: str) -> None:
    check(len(values) > 0 and all(0 < x <= 1 for x in values), cls, name,
          f"must be a non-empty list of capacity fractions in (0, 1], got {values}")


@dataclass(kw_only=True)
class OptimConfig(ConfigBase):
    """AdamW and the warm-up + cosine schedule of pretraining (Table 7; parameter groups: E.2)."""

    lr: float = opt(1.2e-3, "peak learning rate (Table 7, 370M: 1.2e-3; 1.5B: 1.0e-3)")
    warmup_frac: float = opt(0.01, "linear LR warm-up as a fraction of steps (Table 7: 0.01)")
    min_lr_frac: float = opt(0.1, "cosine floor as a fraction of the peak LR (Table 7: 0.1)")
    betas: tuple[float, ...] = opt((0.9, 0.95), "AdamW (beta1, beta2) (Table 7)")
    eps: float = opt(1e-8, "AdamW epsilon (paper silent; torch default)")
    weight_decay: float = opt(0.1, "AdamW weight decay of the decayed group (Table 7: 0.1; groups: E.2)")
    clip: float = opt(1.0, "global gradient-norm clip (Table 7: 1.0; 0 disables)")

    def validate(self) -> None:
        c = "OptimConfig"
        check(self.lr > 0, c, "lr", f"must be > 0, got {self.lr}")
        check(0 <= self.warmup_frac < 1, c, "warmup_frac", f"must lie in [0, 1), got {self.warmup_frac}")
        check(0 <= self.min_lr_frac <= 1, c, "min_lr_frac", f"must lie in [0, 1], got {self.min_lr_frac}")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), c, "betas",
              f"must be two numbers in [0, 1), got {self.betas}")
        check(self.eps > 0, c, "eps", f"must be > 0, got {self.eps}")
        check(self.weight_decay >= 0, c, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.clip >= 0, c, "clip", f"must be >= 0 (0 disables clipping), got {self.clip}")


@dataclass(kw_only=True)
class MixingConfig(ConfigBase):
    """Capacity-mixed training (ESSH Algorithm 1, D.4, Eq. 8); ``capacities`` also serve the post-hoc masks."""

    n_warm_tokens: int = opt(200_000, "tokens trained at full capacity before capacity mixing "
                             "(D.4; paper 250M, CPU default 200k)")
    full_share: float = opt(0.75, "fraction f of each step's micro-batches reserved for full capacity (D.4)")
    capacities: tuple[float, ...] = opt(TRAIN_CAPACITIES, "training capacity fractions xi drawn uniformly by "
                                        "the non-reserved micro-batches (D.4, full included)")
    kl_coef: float = opt(0.5, "coefficient of KL(sg[p_full] || p_T) on reduced micro-batches (Eq. 8)")
    alpha_ff: float = opt(0.5, "FFN weight-gradient scale on reduced micro-batches (D.4)")

    def validate(self) -> None:
        c = "MixingConfig"
        check(self.n_warm_tokens >= 0, c, "n_warm_tokens", f"must be >= 0, got {self.n_warm_tokens}")
        check(0 <= self.full_share <= 1, c, "full_share", f"must lie in [0, 1], got {self.full_share}")
        check_fracs(self.capacities, c, "capacities")
        check(self.kl_coef >= 0, c, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(0 < self.alpha_ff <= 1, c, "alpha_ff", f"must lie in (0, 1], got {self.alpha_ff}")


@dataclass(kw_only=True)
class OrderingConfig(ConfigBase):
    """FFN importance ordering during capacity-mixed training (ESSH D.3)."""

    every: int = opt(500, "FFN importance ordering period in steps (D.3; 0 disables)")
    until: float = opt(0.8, "ordering happens only while step < until x steps (D.3: 0.8)")
    stat_decay: float = opt(0.99, "decay of the running mean of squared FFN activations (paper silent)")

    def validate(self) -> None:
        c = "OrderingConfig"
        check(self.every >= 0, c, "every", f"must be >= 0, got {self.every}")
        check(0 <= self.until <= 1, c, "until", f"must lie in [0, 1], got {self.until}")
        check(0 <= self.stat_decay < 1, c, "stat_decay", f"must lie in [0, 1), got {self.stat_decay}")


@dataclass(kw_only=True)
class BudgetDropoutConfig(ConfigBase):
    """ES-SSM budget dropout (Sec. 4.2, Algorithm 2): warm-up at the full budget, then full-budget anchors."""

    warmup_steps: int = opt(0, "steps at the full budget before sampling (Alg. 2); > 0 overrides warmup_frac")
    warmup_epochs: float = opt(0.0, "warm-up in epochs (E_warmup); overrides warmup_steps when > 0 and needs "
                               "data with len() (batches per epoch)")
    warmup_frac: float = opt(0.1, "warm-up as a fraction of steps when warmup_steps and warmup_epochs are 0 "
                             "(Alg. 2's first phase is on by default; the paper's E_warmup is not in its text, "
                             "0.1 is our choice; 0 disables the warm-up)")
    n_full: int = opt(8, "a full-budget anchor on every n_full-th step after warm-up")

    def validate(self) -> None:
        c = "BudgetDropoutConfig"
        check(self.warmup_steps >= 0, c, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.warmup_epochs >= 0, c, "warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        check(0 <= self.warmup_frac < 1, c, "warmup_frac", f"must lie in [0, 1), got {self.warmup_frac}")
        check(self.n_full >= 0, c, "n_full", f"must be >= 0, got {self.n_full}")


@dataclass(kw_only=True)
class EvalConfig(ConfigBase):
    """Validation during training (E.4); a resumed run may change it."""

    every: int = opt(500, "validate every this many steps (Table 7: 500; 0: only at the end)")
    batches: int = opt(16, "validation batches per tier (E.4: 16 batches of 8 x 2048)")
    tiers: tuple[str, ...] = opt((), "tiers to validate ('T4', 'K8', ...); empty: every deployment tier")
    bytes_per_token: float = opt(0.0, "bytes per token for bits-per-byte; 0: 1 for a 260-entry byte "
                                 "vocabulary, otherwise only bits-per-token are reported")

    def validate(self) -> None:
        c = "EvalConfig"
        check(self.every >= 0, c, "every", f"must be >= 0, got {self.every}")
        check(self.batches >= 1, c, "batches", f"must be >= 1, got {self.batches}")
        check(self.bytes_per_token >= 0, c, "bytes_per_token", f"must be >= 0, got {self.bytes_per_token}")


@dataclass(kw_only=True)
class CheckpointConfig(ConfigBase):
    """Checkpoint cadence and retention; a resumed run may change it."""

    every: int = opt(250, "checkpoint every this many steps (Table 7: 250; 0: only at the end)")
    keep_last: int = opt(3, "checkpoints kept per stage (older ones are deleted)")

    def validate(self) -> None:
        check(self.every >= 0, "CheckpointConfig", "every", f"must be >= 0, got {self.every}")
        check(self.keep_last >= 1, "CheckpointConfig", "keep_last", f"must be >= 1, got {self.keep_last}")


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
        check(self.steps >= 0, c, "steps", f"must be >= 0, got {self.steps}")
        check(self.tokens_per_step >= 0, c, "tokens_per_step", f"must be >= 0, got {self.tokens_per_step}")
        check(self.lr > 0, c, "lr", f"must be > 0, got {self.lr}")
        check(self.tv_coef >= 0, c, "tv_coef", f"must be >= 0, got {self.tv_coef}")
        check_fracs(self.capacities, c, "capacities")
        check(self.capacity_mode in ("per_step", "cycle"), c, "capacity_mode",
              f"must be 'per_step' or 'cycle', got {self.capacity_mode!r}")
        check(0 <= self.warmup_frac < 1, c, "warmup_frac", f"must lie in [0, 1), got {self.warmup_frac}")
        check(0 <= self.min_lr_frac <= 1, c, "min_lr_frac", f"must lie in [0, 1], got {self.min_lr_frac}")
        check(self.weight_decay >= 0, c, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 < self.alpha_ff <= 1, c, "alpha_ff", f"must lie in (0, 1], got {self.alpha_ff}")
