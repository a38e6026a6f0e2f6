"""elastic_ssm.train: recipes, the training loop, checkpoints and DDP (ESSH Alg. 1, D.3-D.8; ES-SSM Sec. 4.2).

Typical use (see docs/training.md)::

    import elastic_ssm as es
    from elastic_ssm.train import TrainConfig, train
    cfg = TrainConfig(steps=200, micro_batch_size=8, grad_accum=4, seq_len=256, out_dir="runs/tiny")
    result = train(es.ESSHConfig.preset("tiny"), batches, cfg, val_data=val_batches)
    model = es.ESSH.from_pretrained(result.model_path, tier="T4")

The same script runs on CPU, on one GPU and under ``torchrun --nproc_per_node N`` (DDP).
"""

from ..config import REFINE_CAPACITIES, TRAIN_CAPACITIES, RefineConfig, TrainConfig
from .budget_dropout import BudgetDropout, make_recipe, resolve_recipe_name
from .capacity_mixed import CapacityMixed, MicroPlan, Recipe, SharedRefinement
from .checkpoint import DataStream, find_checkpoint, load_checkpoint, save_checkpoint
from .dist import DistContext, init_distributed
from .ffn_order import importance_scores, order_ffn_units, permute_optimizer_state
from .loop import TrainResult, build_model, refine, train
from .losses import LossModule, chunked_loss_sums, loss_sums
from .metrics import MetricsLogger, evaluate_tiers
from .optim import WarmupCosine, build_adamw, param_groups
from .preflight import TrainingInterrupted

__all__ = [
    "BudgetDropout", "CapacityMixed", "DataStream", "DistContext", "LossModule", "MetricsLogger",
    "MicroPlan", "REFINE_CAPACITIES", "Recipe", "RefineConfig", "SharedRefinement", "TRAIN_CAPACITIES",
    "TrainConfig", "TrainResult", "WarmupCosine", "build_adamw", "build_model", "chunked_loss_sums",
    "evaluate_tiers", "find_checkpoint", "importance_scores", "init_distributed", "load_checkpoint",
    "loss_sums", "make_recipe", "order_ffn_units", "param_groups", "permute_optimizer_state", "refine",
    "resolve_recipe_name", "save_checkpoint", "train", "TrainingInterrupted",
]
