"""Baseline models of the ESSH paper's comparisons (E.6, Tables 8, 9, 54): Transformer++ and MatFormer."""

from .transformer import KVCache, MatFormer, MatFormerConfig, TransformerConfig, TransformerPP

__all__ = ["KVCache", "MatFormer", "MatFormerConfig", "TransformerConfig", "TransformerPP"]
