"""Causal convolution of a sequence with the fixed Hankel filters (ES-SSM paper Eq. 3-4).

``naive_causal_conv`` is the specification (a direct loop); ``fft_causal_conv`` is the fast path used
by ``layers/es_ssm.py`` (one batched real FFT, float32 even under bf16 autocast). Both map
u [B, T, D] and phi [K, L] (L >= T) to y [B, T, K, D].
"""

from .fft import fft_causal_conv, next_fast_len
from .naive import naive_causal_conv

__all__ = ["fft_causal_conv", "naive_causal_conv", "next_fast_len"]
