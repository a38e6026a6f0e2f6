"""Direct causal convolution with the Hankel filters: the specification of ``fft_causal_conv``.

ES-SSM paper Eq. 3 / Eq. 4 use the causal convolution of every input feature with every fixed filter
``Phi_k = (phi_k(0), ..., phi_k(L-1))``; the tau = 0 term is included (the feedthrough is absorbed into
the kernel, Sec. 3)::

    y_k(t) = sum_{tau=0}^{t} phi_k(tau) u(t - tau),        t = 0, ..., T-1,  k = 1, ..., K

Zero initial conditions (inputs before t = 0 are zero). This module is a plain loop over t, works in
any floating dtype (float64 for the reference tests) and is differentiable by autograd."""

from __future__ import annotations

import torch

__all__ = ["naive_causal_conv", "check_conv_inputs"]


def check_conv_inputs(u: torch.Tensor, phi: torch.Tensor) -> None:
    """Validate ``u`` [B, T, D] and ``phi`` [K, L]; raise ``ValueError`` naming the problem and the fix."""
    if not isinstance(u, torch.Tensor) or not isinstance(phi, torch.Tensor):
        raise TypeError("causal conv expects torch tensors u [B, T, D] and phi [K, L]")
    if u.dim() != 3:
        raise ValueError(f"u must have shape [B, T, D], got {tuple(u.shape)}; add a batch dim with u[None]")
    if phi.dim() != 2:
        raise ValueError(f"phi must have shape [K, L] (one filter per row), got {tuple(phi.shape)}")
    if not u.is_floating_point() or not phi.is_floating_point():
        raise ValueError(f"u and phi must be floating point, got {u.dtype} and {phi.dtype}")
    T, L = u.shape[1], phi.shape[1]
    if T < 1 or phi.shape[0] < 1:
        raise ValueError(f"empty convolution: T={T}, K={phi.shape[0]}; pass at least one step and one filter")
    if T > L:
        raise ValueError(f"sequence length T={T} exceeds the filter length L={L} this model was built for; build "
                         f"with seq_len >= T (or split the input into windows of at most {L} steps)")


def naive_causal_conv(u: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Direct causal convolution (the spec) of u [B, T, D] with phi [K, L] (L >= T): y [B, T, K, D] with
    ``y[b, t, k, d] = sum_{tau <= t} phi[k, tau] * u[b, t - tau, d]``, in the promoted dtype of u and phi."""
    check_conv_inputs(u, phi)
    dtype = torch.promote_types(u.dtype, phi.dtype)
    u, phi = u.to(dtype), phi.to(dtype)
    T = u.shape[1]
    rows = []
    for t in range(T):
        taps = phi[:, : t + 1].flip(-1)  # [K, t+1], taps[k, s] = phi_k(t - s)
        past = u[:, : t + 1]  # [B, t+1, D], past[:, s] = u(s)
        rows.append(torch.einsum("ks,bsd->bkd", taps, past))  # [B, K, D]
    return torch.stack(rows, dim=1)  # [B, T, K, D]
