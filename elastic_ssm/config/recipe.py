"""The sections of ``TrainConfig``: optimizer, capacity mixing, FFN ordering, budget dropout, evaluation,
checkpoints and shared refinement (ESSH Table 7 / Table 55, Appendices D.3-D.8; ES-SSM Sec. 4.2). Defaults
are the papers' constants except where the help text states a CPU default (``n_warm_tokens``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import AtLeast1, Betas, ConfigBase, Frac01, Fracs, NonNeg, NonNegF, Pos, Share, Unit, opt
from .essh import ESSH_TIER_XI

__all__ = ["OptimConfig", "MixingConfig", "OrderingConfig", "BudgetDropoutConfig", "EvalConfig",
           "CheckpointConfig", "RefineConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "T1_T9"]

#: The ten pretraining capacities xi of ESSH D.4 / Table 55 (full capacity included).
TRAIN_CAPACITIES = (1 / 16, 3 / 32, 1 / 8, 5 / 32, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
#: Shared-refinement capacities of the 370M run, {2, 4, 8, 16, 24} / 32 (D.8, Table 55).
REFINE_CAPACITIES = tuple(n / 32 for n in (2, 4, 8, 16, 24))
#: T1-T9 of the deployment tiers, {2,4,7,10,13,17,20,24,28}/32 (D.1): the 1.5B refinement capacities (D.8).
T1_T9 = ESSH_TIER_XI[:-1]

CapacityMode = Literal["per_step", "cycle"]


@dataclass(kw_only=True)
class OptimConfig(ConfigBase):
    """AdamW and the warm-up + cosine schedule of pretraining (Table 7; parameter groups: E.2)."""

    lr: Pos = opt(1.2e-3, "peak learning rate (Table 7, 370M: 1.2e-3; 1.5B: 1.0e-3)")
    warmup_frac: Frac01 = opt(0.01, "linear LR warm-up as a fraction of steps (Table 7: 0.01)")
    min_lr_frac: Unit = opt(0.1, "cosine floor as a fraction of the peak LR (Table 7: 0.1)")
    betas: Betas = opt((0.9, 0.95), "AdamW (beta1, beta2) (Table 7)")
    eps: Pos = opt(1e-8, "AdamW epsilon (paper silent; torch default)")
    weight_decay: NonNegF = opt(0.1, "AdamW weight decay of the decayed group (Table 7: 0.1; groups: E.2)")
    clip: NonNegF = opt(1.0, "global gradient-norm clip (Table 7: 1.0; 0 disables)")


@dataclass(kw_only=True)
class MixingConfig(ConfigBase):
    """Capacity-mixed training (ESSH Algorithm 1, D.4, Eq. 8); ``capacities`` also serve the post-hoc masks."""

    n_warm_tokens: NonNeg = opt(200_000, "tokens trained at full capacity before capacity mixing "
                             "(D.4; paper 250M, CPU default 200k)")
    full_share: Unit = opt(0.75, "fraction f of each step's micro-batches reserved for full capacity (D.4)")
    capacities: Fracs = opt(TRAIN_CAPACITIES, "training capacity fractions xi drawn uniformly by "
                                        "the non-reserved micro-batches (D.4, full included)")
    kl_coef: NonNegF = opt(0.5, "coefficient of KL(sg[p_full] || p_T) on reduced micro-batches (Eq. 8)")
    alpha_ff: Share = opt(0.5, "FFN weight-gradient scale on reduced micro-batches (D.4)")


@dataclass(kw_only=True)
class OrderingConfig(ConfigBase):
    """FFN importance ordering during capacity-mixed training (ESSH D.3)."""

    every: NonNeg = opt(500, "FFN importance ordering period in steps (D.3; 0 disables)")
    until: Unit = opt(0.8, "ordering happens only while step < until x steps (D.3: 0.8)")
    stat_decay: Frac01 = opt(0.99, "decay of the running mean of squared FFN activations (paper silent)")


@dataclass(kw_only=True)
class BudgetDropoutConfig(ConfigBase):
    """ES-SSM budget dropout (Sec. 4.2, Algorithm 2): warm-up at the full budget, then full-budget anchors."""

    warmup_steps: NonNeg = opt(0, "steps at the full budget before sampling (Alg. 2); > 0 overrides warmup_frac")
    warmup_epochs: NonNegF = opt(0.0, "warm-up in epochs (E_warmup); overrides warmup_steps when > 0 and needs "
                               "data with len() (batches per epoch)")
    warmup_frac: Frac01 = opt(0.1, "warm-up as a fraction of steps when warmup_steps and warmup_epochs are 0 "
                             "(Alg. 2's first phase is on by default; the paper's E_warmup is not in our copy of it, "
                             "which stops after App. B.7, in Alg. 2; 0.1 is our choice; 0 disables the warm-up)")
    n_full: NonNeg = opt(8, "a full-budget anchor on every n_full-th step after warm-up")


@dataclass(kw_only=True)
class EvalConfig(ConfigBase):
    """Validation during training (E.4); a resumed run may change it."""

    every: NonNeg = opt(500, "validate every this many steps (Table 7: 500; 0: only at the end)")
    batches: AtLeast1 = opt(16, "validation batches per tier (E.4: 16 batches of 8 x 2048)")
    tiers: tuple[str, ...] = opt((), "tiers to validate ('T4', 'K8', ...); empty: every deployment tier")
    bytes_per_token: NonNegF = opt(0.0, "bytes per token for bits-per-byte; 0: 1 for a 260-entry byte "
                                 "vocabulary, otherwise only bits-per-token are reported")


@dataclass(kw_only=True)
class CheckpointConfig(ConfigBase):
    """Checkpoint cadence and retention; a resumed run may change it."""

    every: NonNeg = opt(250, "checkpoint every this many steps (Table 7: 250; 0: only at the end)")
    keep_last: AtLeast1 = opt(3, "checkpoints kept per stage (older ones are deleted)")


@dataclass(kw_only=True)
class RefineConfig(ConfigBase):
    """Shared refinement (SR), ESSH Appendix D.8: L = CE(p_full) + CE(p_T) + tv_coef TV(sg[p_full], p_T)."""

    steps: NonNeg = opt(0, "SR optimizer steps after pretraining (0: no SR stage; paper 370M: 2060, 1.5B: 4120)")
    tokens_per_step: NonNeg = opt(0, "SR global batch in tokens, independent of pretraining (Table 55: 131,072); "
                               "0: the pretraining batch. Micro-batches keep micro_batch_size x seq_len")
    lr: Pos = opt(6e-5, "SR peak learning rate (Table 55: 6e-5)")
    tv_coef: NonNegF = opt(5.0, "coefficient of the total-variation distillation term (D.8: 5)")
    capacities: Fracs = opt(REFINE_CAPACITIES, "SR capacity fractions ({2,4,8,16,24}/32 at 370M)")
    capacity_mode: CapacityMode = opt("per_step", "'per_step': one capacity per step for all its micro-batches (370M);"
                             " 'cycle': shuffle the capacities each step and cycle over micro-batches (1.5B)")
    warmup_frac: Frac01 = opt(0.05, "SR linear warm-up as a fraction of SR steps (D.8: 0.05)")
    min_lr_frac: Unit = opt(0.0, "SR cosine floor as a fraction of the SR peak (D.8: decay toward zero)")
    weight_decay: NonNegF = opt(0.1, "SR AdamW weight decay on every tensor with >= 2 dims (D.8: 0.1)")
    alpha_ff: Share = opt(0.5, "retained-FFN gradient scale of the reduced branch during SR (D.8: 0.5)")

