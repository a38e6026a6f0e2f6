"""CPU float64 tests of the ESSH scan's fla path, with the stand-in kernel: the GLA mapping against the spec, the
theta-gradient segments (a NaN isolated once), padded heads and widths, fla's chunk-local cumsum, chunk sizes."""

import importlib
import math

import fla_stand_in
import pytest
import torch
from test_spectral_scan import F64, NAMES, _grads, inputs_of, make_inputs, run, tables

from elastic_ssm.ops import naive_spectral_scan
from elastic_ssm.ops.spectral_scan.chunk_fla import gla_inputs, gla_outputs
from elastic_ssm.ops.spectral_scan.inputs import isolate_nonfinite


def naive_gla(q, k, v, g, h0):
    """Tokenwise GLA: S_t = diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t (scale 1). [B, T, H, D]."""
    S = h0.clone()
    outs = []
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhd,bhdp->bhp", q[:, t], S))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T", [1, 65])
def test_gla_mapping_matches_spec(T):
    x = make_inputs(T=T, clock=0.5, strong=(2, 1, 30.0))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    q, k, v, g, h0 = gla_inputs(*inputs_of(gla_inputs, leaves), initial_state=leaves["initial_state"])
    assert q.shape == (2, T, 3, 8) and g.shape == q.shape and h0.shape == (2, 3, 8, 5)
    o, S = naive_gla(q, k, v, g, h0)
    z, h = gla_outputs(o, S, leaves["v"], leaves["write"], leaves["read"], tables(leaves))
    z_ref, h_ref = run(naive_spectral_scan, x)
    assert (z - z_ref).abs().max() < 1e-10 and (h - h_ref).abs().max() < 1e-10
    loss = (z * torch.cos(z)).sum() + (h * h.detach().sign()).sum()
    grads = list(torch.autograd.grad(loss, [leaves[n] for n in NAMES]))
    grads[4] = grads[4] * x["rho"]
    for name, gr, r in zip(NAMES, grads, _grads(naive_spectral_scan, x)):
        assert (gr - r).abs().max() <= 1e-9 * max(1.0, r.abs().max().item()), name


@pytest.mark.parametrize("dtype,compute", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, None)])
def test_fla_path_with_stand_in_kernel(monkeypatch, dtype, compute):
    """``fla_spectral_scan`` end to end on CPU, forward and backward, through the custom ops of ``chunk_fla.py``
    with a tokenwise stand-in for fla's ``chunk_gla_fwd`` / ``chunk_gla_bwd`` (tests/fla_stand_in.py)."""
    calls = fla_stand_in.install(monkeypatch)
    fla_spectral_scan = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla").fla_spectral_scan
    x = make_inputs(T=70, clock=0.3, strong=(1, 2, 30.0))
    low = {n: t.to(dtype) if n in NAMES[:4] else t.float() for n, t in x.items()}
    leaves = {n: t.clone().requires_grad_() for n, t in low.items()}
    z, h = run(fla_spectral_scan, leaves, compute_dtype=compute)
    assert calls["fwd"] == 1 and calls["chunk_size"] == 64 and z.dtype == dtype and h.dtype == torch.float32
    assert calls["heads"] == 4              # K = 3 channels run as 4 heads (chunk_fla.head_bucket), one sliced off
    ref = {n: t.double().requires_grad_() for n, t in low.items()}
    z_ref, h_ref = run(naive_spectral_scan, ref)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (z.double() - z_ref).abs().max() < tol * z_ref.abs().max()
    assert (h.double() - h_ref).abs().max() < tol * h_ref.abs().max()
    dz, dh = torch.randn(z.shape, dtype=F64), torch.randn(h.shape, dtype=F64)
    loss = lambda z, h: (z.double() * dz).sum() + (h.double() * dh).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(z, h), [leaves[n] for n in NAMES])
    grads_ref = torch.autograd.grad(loss(z_ref, h_ref), [ref[n] for n in NAMES])
    assert calls["bwd"] == 1
    gtol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, gr, r in zip(NAMES, grads, grads_ref):
        if name == "theta" and compute is None:
            continue  # bf16 q, k lose the theta gradient's digits (see fla_spectral_scan's docstring)
        assert (gr.double() - r).abs().max() <= gtol * r.abs().max(), name


def test_fla_path_with_a_theta_gradient_scans_in_segments_and_equals_the_spec(monkeypatch):
    """With a theta gradient and T > ``GRAD_SEGMENT``, ``fla_spectral_scan`` folds the segments (phases from each
    one's own start) into the batch of one kernel call and chains their states outside it: the kernel's error in
    dq, dk is then multiplied by at most the segment's length in ``d theta`` (README "theta gradient"). Through the
    float64 stand-in (its gates float32, as fla's): the spec's values and gradients to the one-call path's 1e-4;
    without a theta gradient it stays one call over the whole sequence."""
    calls = fla_stand_in.install(monkeypatch)
    mod = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla")
    monkeypatch.setattr(mod, "GRAD_SEGMENT", 32)
    x = make_inputs(T=70, clock=0.3, strong=(1, 2, 30.0))
    for name, g_fla, g_ref in zip(NAMES, _grads(mod.fla_spectral_scan, x, compute_dtype=F64),
                                  _grads(naive_spectral_scan, x)):
        assert (g_fla - g_ref).abs().max() <= 1e-4 * g_ref.abs().max(), name
    # segments of 32, 32 and 6 (+ 26 zeros) tokens, each row's three in the batch of one call
    assert calls["fwd"] == 1 and calls["bwd"] == 1 and tuple(calls["batch_length"]) == (3 * x["v"].shape[0], 32)
    for T, seg in ((64, 32), (33, 32), (70, 1)):   # whole segments; one token in the last; > 64 (_decay_scan's groups)
        monkeypatch.setattr(mod, "GRAD_SEGMENT", seg)
        y = make_inputs(T=T, clock=0.3, strong=(1, 2, 30.0))
        for name, g_fla, g_ref in zip(NAMES, _grads(mod.fla_spectral_scan, y, compute_dtype=F64),
                                      _grads(naive_spectral_scan, y)):
            assert (g_fla - g_ref).abs().max() <= 1e-4 * g_ref.abs().max(), (T, name)
    calls["fwd"], whole = 0, (x["v"].shape[0], 70)
    with torch.no_grad():
        z, h = run(mod.fla_spectral_scan, x, compute_dtype=F64)
    z_ref, h_ref = run(naive_spectral_scan, x)
    assert calls["fwd"] == 1 and tuple(calls["batch_length"]) == whole
    assert (z - z_ref).abs().max() < 1e-5 * z_ref.abs().max()
    assert (h - h_ref).abs().max() < 1e-5 * h_ref.abs().max()
    leaves = {n: t.clone().requires_grad_(n != "theta") for n, t in x.items()}
    mod.fla_spectral_scan(*inputs_of(mod.fla_spectral_scan, leaves), initial_state=leaves["initial_state"])
    assert calls["fwd"] == 2 and tuple(calls["batch_length"]) == whole   # no theta gradient: one call


def test_segments_isolate_a_nan_once_and_keep_earlier_positions_finite(monkeypatch):
    """The segmented theta-gradient path checks the whole sequence for non-finite inputs once (one host sync, not
    one per segment); a NaN in a later segment reaches neither earlier positions, nor the other row, nor any
    gradient of a loss on them."""
    fla_stand_in.install(monkeypatch)
    mod = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla")
    monkeypatch.setattr(mod, "GRAD_SEGMENT", 32)
    checks = []
    monkeypatch.setattr(mod, "isolate_nonfinite", lambda *a: checks.append(1) or isolate_nonfinite(*a))
    x = make_inputs(T=100, clock=0.3)
    x["v"][0, 50, 0, 0] = math.nan
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    z, _ = run(mod.fla_spectral_scan, leaves, compute_dtype=F64)
    assert checks == [1] and torch.isfinite(z[0, :50]).all() and torch.isfinite(z[1]).all()
    assert not torch.isfinite(z[0, 50:, 0]).all()
    grads = torch.autograd.grad(z[0, :50].sum() + z[1].sum(), [leaves[n] for n in NAMES])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("H", [1, 3, 5, 8, 11])
def test_gla_chunk_pads_heads_to_a_power_of_two_and_widths_to_16(monkeypatch, H):
    """fla autotunes per head count, and its backward's ``tl.dot`` needs widths >= 16: ``gla_chunk`` runs the
    kernels on ``head_bucket(H)`` heads and Dk, Dv of 16 and returns the unpadded outputs, states and gradients
    exactly (heads never mix; the tiny preset's Dk = Dv = 8 failed on an H100 with fla-core 0.6.0)."""
    calls = fla_stand_in.install(monkeypatch)
    chunk_fla = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla")
    assert [chunk_fla.head_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    g0 = torch.Generator().manual_seed(H)
    q, k, g = (torch.randn(2, 19, H, 4, generator=g0) for _ in range(3))
    v, h0 = torch.randn(2, 19, H, 3, generator=g0), torch.randn(2, H, 4, 3, generator=g0)
    g = -torch.nn.functional.softplus(g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = chunk_fla.gla_chunk(*leaves[:4], initial_state=leaves[4], output_final_state=True)
    assert calls["heads"] == chunk_fla.head_bucket(H) and o.shape == (2, 19, H, 3) and ht.shape == (2, H, 4, 3)
    assert calls["widths"] == (16, 16)
    assert calls["given_cumsum"] == 1       # the cumulative gate from torch (fla's cumsum autotunes per B)
    ref = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    o_ref, ht_ref = fla_stand_in.naive_gla(*ref)
    assert (o.double() - o_ref).abs().max() < 1e-5 and (ht.double() - ht_ref).abs().max() < 1e-5
    do, dht = torch.randn(o.shape, generator=g0), torch.randn(ht.shape, generator=g0)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), ref)
    for name, gr, r in zip("q k v g h0".split(), grads, grads_ref):
        assert gr.shape == r.shape and (gr.double() - r).abs().max() < 1e-4 * max(1.0, r.abs().max()), name


@pytest.mark.parametrize("T,C", [(1, 16), (19, 16), (64, 64), (130, 64)])
def test_local_cumsum_log2_is_fla_chunk_local_cumsum(T, C):
    """fla's ``chunk_local_cumsum(g, C, scale=1/ln 2)``: cumulate within each chunk of C positions, then scale."""
    from elastic_ssm.ops.spectral_scan.chunk_fla import local_cumsum_log2

    g = -torch.rand(2, T, 3, 4, dtype=F64)
    got = local_cumsum_log2(g, C)
    want = torch.empty_like(g)
    for start in range(0, T, C):
        want[:, start:start + C] = g[:, start:start + C].cumsum(1) / math.log(2)
    assert got.dtype == torch.float32 and got.is_contiguous() and (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("T,C", [(5, 16), (16, 16), (17, 64), (32, 64), (40, 64)])
def test_gla_chunk_never_asks_fla_for_chunks_of_32(monkeypatch, T, C):
    """``chunk_fla.chunk_length``: 16 up to 16 positions, else 64 (fla-core 0.6.0's output kernel stopped an H200 at
    chunk 32, prompts of 17-32 tokens); a chunk longer than the sequence still gives the exact recurrence."""
    calls = fla_stand_in.install(monkeypatch)
    chunk_fla = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla")
    g0 = torch.Generator().manual_seed(T)
    q, k, g = (torch.randn(1, T, 4, 16, generator=g0) for _ in range(3))
    v, h0 = torch.randn(1, T, 4, 8, generator=g0), torch.randn(1, 4, 16, 8, generator=g0)
    g = -torch.nn.functional.softplus(g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = chunk_fla.gla_chunk(*leaves[:4], initial_state=leaves[4], output_final_state=True)
    assert calls["chunk_size"] == C
    ref = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    o_ref, ht_ref = fla_stand_in.naive_gla(*ref)
    assert (o.double() - o_ref).abs().max() < 1e-4 * o_ref.abs().max()
    assert (ht.double() - ht_ref).abs().max() < 1e-4 * ht_ref.abs().max()
    do, dht = torch.randn(o.shape, generator=g0), torch.randn(ht.shape, generator=g0)     # and the backward
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), ref)
    for name, gr, r in zip("q k v g h0".split(), grads, grads_ref):
        assert (gr.double() - r).abs().max() < 1e-4 * max(1.0, r.abs().max()), name
