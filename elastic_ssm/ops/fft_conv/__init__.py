"""Causal convolution with the fixed Hankel filters (ES-SSM paper Eq. 3-4): u [B, T, D], phi [K, L] -> [B, T, K, D].

``naive.py`` is the spec; ``fft_causal_conv`` (Sec. 4.1, Eq. 4): real FFTs of length ``next_fast_len(2T)`` (no
wrap-around), the input transformed once for all K channels, float32 (float64 for float64 inputs) with autocast off."""

from __future__ import annotations

import functools

import torch

from .naive import check_conv_inputs, naive_causal_conv

__all__ = ["fft_causal_conv", "naive_causal_conv", "next_fast_len"]


@functools.lru_cache(maxsize=512)
def next_fast_len(n: int) -> int:
    """Smallest even ``2^a 3^b 5^c >= n`` (fast for pocketfft and cuFFT alike)."""
    if n < 1:
        raise ValueError(f"next_fast_len needs n >= 1, got {n}")
    best = 2 ** max(1, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = 2 * p35  # at least one factor of 2: an even length
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


def fft_causal_conv(u: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Causal convolution of every feature of u [B, T, D] with every filter phi [K, L] (L >= T) by one batched
    real FFT -> y [B, T, K, D] in float32 (float64 if an input is), a view with memory layout [B, K, D, T];
    ``naive_causal_conv(u, phi)`` up to rounding. ValueError for wrong ranks or dtypes, or T > L."""
    check_conv_inputs(u, phi)
    B, T, D = u.shape
    dtype = torch.float64 if torch.float64 in (u.dtype, phi.dtype) else torch.float32
    n = next_fast_len(2 * T)
    with torch.autocast(device_type=u.device.type, enabled=False):
        x = u.to(dtype).transpose(1, 2)  # [B, D, T]
        taps = phi[:, :T].to(dtype)  # [K, T]
        x_f = torch.fft.rfft(x, n=n)  # [B, D, F]
        h_f = torch.fft.rfft(taps, n=n)  # [K, F]
        y_f = x_f.unsqueeze(1) * h_f[None, :, None, :]  # [B, K, D, F]
        y = torch.fft.irfft(y_f, n=n)[..., :T].contiguous()  # [B, K, D, T]
    return y.permute(0, 3, 1, 2)  # [B, T, K, D] view
