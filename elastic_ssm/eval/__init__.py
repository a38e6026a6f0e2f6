"""elastic_ssm.eval: per-tier held-out loss, perplexity and bits-per-byte (``evaluate_tiers``)."""

from .perplexity import TierEval, evaluate_tiers, format_evals

__all__ = ["TierEval", "evaluate_tiers", "format_evals"]
