"""fft_causal_conv against the direct-loop specification naive_causal_conv (forward and backward)."""

import pytest
import torch

from elastic_ssm.ops.fft_conv import fft_causal_conv, naive_causal_conv, next_fast_len

TS = [1, 63, 64, 65, 130]


def _inputs(T, dtype=torch.float64, B=2, D=3, K=4, L=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, T, D, generator=g, dtype=dtype)
    phi = torch.randn(K, L or T + 5, generator=g, dtype=dtype)
    return u, phi


@pytest.mark.parametrize("T", TS)
def test_forward_matches_naive_float64(T):
    u, phi = _inputs(T)
    y = fft_causal_conv(u, phi)
    assert y.shape == (2, T, 4, 3) and y.dtype == torch.float64
    torch.testing.assert_close(y, naive_causal_conv(u, phi), rtol=0, atol=1e-12)


@pytest.mark.parametrize("T", TS)
def test_forward_float32_close_to_float64_spec(T):
    u, phi = _inputs(T)
    y = fft_causal_conv(u.float(), phi.float())
    assert y.dtype == torch.float32
    ref = naive_causal_conv(u, phi)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= 2e-6 * max(scale, 1.0)


def test_naive_is_the_definition():
    u, phi = _inputs(7, K=2, D=1)
    y = naive_causal_conv(u, phi)
    for t in range(7):
        want = sum(phi[:, tau, None] * u[:, t - tau, None, :] for tau in range(t + 1))  # [B, K, D]
        torch.testing.assert_close(y[:, t], want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("T", TS)
def test_backward_matches_naive(T):
    u, phi = _inputs(T)
    u1, phi1 = u.clone().requires_grad_(), phi.clone().requires_grad_()
    u2, phi2 = u.clone().requires_grad_(), phi.clone().requires_grad_()
    w = torch.randn(2, T, 4, 3, dtype=torch.float64)
    (fft_causal_conv(u1, phi1) * w).sum().backward()
    (naive_causal_conv(u2, phi2) * w).sum().backward()
    torch.testing.assert_close(u1.grad, u2.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(phi1.grad, phi2.grad, rtol=0, atol=1e-11)
    assert torch.all(phi1.grad[:, T:] == 0)  # taps beyond T never enter


@pytest.mark.parametrize("T", [1, 4, 7])
def test_gradcheck(T):
    u, phi = _inputs(T, B=1, D=2, K=2, L=T + 1)
    assert torch.autograd.gradcheck(fft_causal_conv, (u.requires_grad_(), phi.requires_grad_()))


def test_bf16_autocast_computes_in_float32():
    u, phi = _inputs(65, dtype=torch.float32)
    ub = u.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fft_causal_conv(ub, phi)
        y32 = fft_causal_conv(u, phi)
    assert y.dtype == torch.float32 and y32.dtype == torch.float32
    assert torch.equal(y, fft_causal_conv(ub.float(), phi))  # upcast, then float32 FFT
    assert torch.equal(y32, fft_causal_conv(u, phi))  # autocast does not reach the FFT


def test_low_precision_filters_upcast():
    u, phi = _inputs(20, dtype=torch.float32)
    y = fft_causal_conv(u.half(), phi.bfloat16())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, naive_causal_conv(u.half().float(), phi.bfloat16().float()),
                               rtol=1e-5, atol=1e-5)


def test_output_layout_is_time_fastest_view():
    u, phi = _inputs(16, dtype=torch.float32)
    y = fft_causal_conv(u, phi)
    assert y.permute(0, 2, 3, 1).is_contiguous()


def test_errors_name_the_problem():
    u, phi = _inputs(10, L=8)
    with pytest.raises(ValueError, match=r"T=10 exceeds the filter length L=8.*seq_len >= T"):
        fft_causal_conv(u, phi)
    with pytest.raises(ValueError, match=r"T=10 exceeds"):
        naive_causal_conv(u, phi)
    with pytest.raises(ValueError, match=r"\[B, T, D\]"):
        fft_causal_conv(u[0], phi)
    with pytest.raises(ValueError, match=r"\[K, L\]"):
        fft_causal_conv(u, phi[0])
    with pytest.raises(ValueError, match="floating point"):
        fft_causal_conv(u.long(), torch.randn(3, 12))
    with pytest.raises(ValueError, match="empty"):
        fft_causal_conv(u[:, :0], phi)


def test_next_fast_len():
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    for n in range(1, 400):
        m = next_fast_len(n)
        assert m >= n and m % 2 == 0 and smooth(m)
        assert not any(smooth(j) and j % 2 == 0 for j in range(n, m))
    with pytest.raises(ValueError):
        next_fast_len(0)
