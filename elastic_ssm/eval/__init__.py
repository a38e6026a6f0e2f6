"""elastic_ssm.eval: per-tier held-out loss, perplexity and bits-per-byte (``evaluate_tiers``, named tiers
or capacity fractions) and the spectral channel importance profile (``channel_importance``, Table 31)."""

from .importance import ImportanceResult, channel_importance
from .perplexity import TierEval, evaluate_tiers, format_evals

__all__ = ["ImportanceResult", "TierEval", "channel_importance", "evaluate_tiers", "format_evals"]
