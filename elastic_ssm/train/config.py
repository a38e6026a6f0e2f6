"""Moved to ``elastic_ssm.config`` (``config/train.py``, ``config/recipe.py``); this module keeps ``from
elastic_ssm.train.config import TrainConfig`` (and the rest) working for code written against earlier versions."""

from ..config.recipe import REFINE_CAPACITIES, TRAIN_CAPACITIES, RefineConfig
from ..config.train import PARALLEL, PRECISIONS, RECIPES, TRAIN_PRESETS, TrainConfig, resolve_precision

__all__ = ["TrainConfig", "RefineConfig", "TRAIN_CAPACITIES", "REFINE_CAPACITIES", "RECIPES", "PARALLEL",
           "TRAIN_PRESETS", "PRECISIONS", "resolve_precision"]
