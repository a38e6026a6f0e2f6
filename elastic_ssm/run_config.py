"""Moved to ``elastic_ssm.config`` (``config/run.py``); this module keeps ``from elastic_ssm.run_config import
RunConfig`` (and ``DataConfig``, ``ModelChoice``) working for code written against earlier versions."""

from .config.run import DataConfig, ModelChoice, RunConfig

__all__ = ["DataConfig", "ModelChoice", "RunConfig"]
