"""elastic_ssm.elastic: tiers (two-rate map, exact counts) and slicing."""

from .tiers import (
    Tier,
    capacity_tier,
    channels_for,
    ffn_width_for,
    flops_per_token,
    format_tier_table,
    num_parameters,
    parameter_breakdown,
    resolve_tier,
    state_bytes,
    tier_table,
)

__all__ = ["Tier", "capacity_tier", "channels_for", "ffn_width_for", "flops_per_token", "format_tier_table",
           "num_parameters", "parameter_breakdown", "resolve_tier", "state_bytes", "tier_table"]
