"""Causal convolution with the fixed Hankel filters (ES-SSM paper Eq. 3-4): u [B, T, D], phi [K, L] -> [B, T, K, D]."""

from .fft import fft_causal_conv, next_fast_len
from .naive import naive_causal_conv

__all__ = ["fft_causal_conv", "naive_causal_conv", "next_fast_len"]
