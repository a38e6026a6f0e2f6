"""FFT causal convolution with the Hankel filters (ES-SSM paper Sec. 4.1, Eq. 4).

``fft_causal_conv(u, phi)`` computes the same ``y_k(t) = sum_{tau<=t} phi_k(tau) u(t - tau)`` as
``naive_causal_conv`` for all K filters at once: one real FFT of the input (B*D rows), one real FFT of
the filters (K rows), a broadcast product and one batched inverse real FFT (B*K*D rows), all of length
``n = next_fast_len(2T)`` so the circular convolution has no wrap-around for t < T.

Layout: "convolve once, then gate, then project". The input is transformed once and shared by all K
channels; projecting first (``Phi_k * (M_k u)``) would need K*D forward transforms instead of D. The
gate is a scalar per (t, k), so ``g_k M_k X_k = M_k (g_k X_k)``: the layer scales the convolved
features by the gate *before* the projection and does all K projections plus the channel sum as one
``[K*D, D]`` matrix product (gate-before-projection ordering, see ``layers/es_ssm.py``).

Precision: the transform always runs in float32 (float64 when ``u`` or ``phi`` is float64), with
autocast disabled inside, so bf16/fp16 autocast never reaches the FFT; the result is returned in that
compute dtype (float32 for bf16/fp16/fp32 inputs). The output is a [B, T, K, D] *view* whose memory is
laid out [B, K, D, T] (time fastest, as the inverse FFT writes it); ``.permute(0, 2, 3, 1)`` recovers
that contiguous layout for free. The first T steps are copied out of the length-n inverse transform so a
caller that saves the result for backward holds B*K*D*T values, not B*K*D*n (n ~ 2T).
"""

from __future__ import annotations

import functools

import torch

from .naive import check_conv_inputs

__all__ = ["fft_causal_conv", "next_fast_len", "conv_dtype"]


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


def conv_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The FFT compute dtype: float64 if any input is float64, float32 otherwise."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def fft_causal_conv(u: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Causal convolution of every feature with every filter by one batched real FFT.

    Args:
        u: input sequence, [B, T, D] (any floating dtype; bf16/fp16 are upcast).
        phi: filters, [K, L] with L >= T; only ``phi[:, :T]`` is used.

    Returns:
        y, [B, T, K, D] in float32 (float64 if an input is float64); a view with memory layout
        [B, K, D, T]. Equal to ``naive_causal_conv(u, phi)`` up to FFT rounding.

    Raises:
        ValueError: wrong ranks or dtypes, or T > L (the filters are too short for the sequence).
    """
    check_conv_inputs(u, phi)
    B, T, D = u.shape
    dtype = conv_dtype(u.dtype, phi.dtype)
    n = next_fast_len(2 * T)
    with torch.autocast(device_type=u.device.type, enabled=False):
        x = u.to(dtype).transpose(1, 2)  # [B, D, T]
        taps = phi[:, :T].to(dtype)  # [K, T]
        x_f = torch.fft.rfft(x, n=n)  # [B, D, F]
        h_f = torch.fft.rfft(taps, n=n)  # [K, F]
        y_f = x_f.unsqueeze(1) * h_f[None, :, None, :]  # [B, K, D, F]
        y = torch.fft.irfft(y_f, n=n)[..., :T].contiguous()  # [B, K, D, T]
    return y.permute(0, 3, 1, 2)  # [B, T, K, D] view
