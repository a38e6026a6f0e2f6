"""elastic_ssm.train: recipes, the training loop, checkpoints and DDP / FSDP2 (ESSH Alg. 1, D.3-D.8; ES-SSM
Sec. 4.2). ``train(model_or_cfg, batches, TrainConfig(...))`` runs on CPU, one GPU and under ``torchrun``
(docs/training.md)."""

from ..config import REFINE_CAPACITIES, TRAIN_CAPACITIES, RefineConfig, TrainConfig
from .capacity_mixed import (
    CapacityMixed,
    MicroPlan,
    Recipe,
    SharedRefinement,
    importance_scores,
    order_ffn_units,
    permute_optimizer_state,
)
from .checkpoint import DataStream, find_checkpoint, load_checkpoint, save_checkpoint
from .dist import DistContext, init_distributed
from .loop import TrainResult, refine, train
from .losses import LossModule, chunked_loss_sums, ffn_grad_scaled, loss_sums
from .metrics import MetricsLogger, validation_records
from .preflight import TrainingInterrupted
from .recipes import BudgetDropout, WarmupCosine, build_adamw, make_recipe, param_groups, resolve_recipe_name

__all__ = [
    "BudgetDropout", "CapacityMixed", "DataStream", "DistContext", "LossModule", "MetricsLogger", "MicroPlan",
    "REFINE_CAPACITIES", "Recipe", "RefineConfig", "SharedRefinement", "TRAIN_CAPACITIES", "TrainConfig",
    "TrainResult", "WarmupCosine", "build_adamw", "chunked_loss_sums", "ffn_grad_scaled", "find_checkpoint",
    "importance_scores", "init_distributed", "load_checkpoint", "loss_sums", "make_recipe", "order_ffn_units",
    "param_groups", "permute_optimizer_state", "refine", "resolve_recipe_name", "save_checkpoint", "train",
    "TrainingInterrupted", "validation_records",
]
