"""Baseline models for the systems comparison (ESSH paper E.6, Table 54): Transformer++."""

from .transformer import KVCache, TransformerConfig, TransformerPP

__all__ = ["KVCache", "TransformerConfig", "TransformerPP"]
