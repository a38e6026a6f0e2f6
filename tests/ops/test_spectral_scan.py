"""CPU float64 tests of the ESSH scan op: tokenwise spec vs chunked torch path vs explicit interaction matrix
(Eq. 13), gradients, decode step, channel-prefix consistency, dispatch, bad inputs. The fla path with the stand-in
kernel: ``test_spectral_scan_fla.py``."""

import importlib
import logging
import math

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.ops import (
    ModalTables,
    chunk_spectral_scan,
    naive_spectral_scan,
    resolve_backend,
    spectral_scan,
    spectral_scan_step,
)

F64 = torch.float64
NAMES = ("v", "write", "read", "clock", "rho", "theta", "kc", "ks", "a", "initial_state")


def make_inputs(B=2, T=70, K=3, M=4, P=5, clock=0.1, strong=None, rho_min=0.5, tiny_rho=False, seed=0):
    """Random scan inputs (float64). ``strong`` = (k, i, size): one mode gets clocks ~ size (20-50 range)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.rand(*s, generator=g, dtype=F64)  # noqa: E731
    v = torch.randn(B, T, K, P, generator=g, dtype=F64)
    write, read = 2 * rnd(B, T, K, M), 2 * rnd(B, T, K, M)
    clk = clock * (0.2 + rnd(B, T, K, M))
    if strong is not None:
        k, i, size = strong
        clk[:, :, k, i] = size * (0.4 + 0.6 * rnd(B, T))
    rho = rho_min + (0.999 - rho_min) * rnd(K, M)
    if tiny_rho:
        rho[0, 0] = 1e-6
    theta = math.pi * (2 * rnd(K, M) - 1)
    kc, ks = torch.randn(K, M, generator=g, dtype=F64), torch.randn(K, M, generator=g, dtype=F64)
    h0 = torch.randn(B, K, M, 2, P, generator=g, dtype=F64)
    return dict(v=v, write=write, read=read, clock=clk, rho=rho, theta=theta, kc=kc, ks=ks, a=rnd(K, M),
                initial_state=h0)


def interaction_form(x):
    """Eq. 13 as an explicit [T, T] matrix per (batch, channel), plus the entering-state term of Eq. 28."""
    v, w, r, clk = x["v"], x["write"], x["read"], x["clock"]
    rho, theta, kc, ks, a, h0 = x["rho"], x["theta"], x["kc"], x["ks"], x["a"], x["initial_state"]
    T = v.shape[1]
    t = torch.arange(1, T + 1, dtype=F64)
    lag = t[:, None] - t[None, :]  # [T, T] t - s
    q = torch.cumsum(clk, 1).permute(0, 2, 3, 1)  # [B, K, M, T] accumulated clock q(t)
    logdec = lag * torch.log(rho)[..., None, None] - (q[..., :, None] - q[..., None, :])  # [B, K, M, T, T]
    causal = lag > 0
    dec = torch.exp(torch.where(causal, logdec, torch.full_like(logdec, -math.inf)))
    ang = theta[..., None, None] * lag
    psi = kc[..., None, None] * torch.cos(ang) - ks[..., None, None] * torch.sin(ang)  # psi / rho^tau
    rw = r.permute(0, 2, 3, 1)[..., :, None] * w.permute(0, 2, 3, 1)[..., None, :]  # [B, K, M, T, T]
    G = (rw * dec * psi).sum(2)  # strictly causal part of Eq. 13
    G = G + torch.diag_embed(((1 - a) * kc * r * w).sum(-1).permute(0, 2, 1))  # lag-0 coefficient
    z = torch.einsum("bkts,bskp->btkp", G, v)
    # entering state: r(t) rho^t e^{-q(t)} kappa^T R(theta t) H(0)
    ph = theta[..., None] * t  # [K, M, T]
    qk = torch.stack([kc[..., None] * torch.cos(ph) - ks[..., None] * torch.sin(ph),
                      -kc[..., None] * torch.sin(ph) - ks[..., None] * torch.cos(ph)], -1)  # R(th t)^T kappa
    carry = torch.exp(t * torch.log(rho)[..., None] - q)  # [B, K, M, T]
    coef = r.permute(0, 2, 3, 1) * carry  # [B, K, M, T]
    return z + torch.einsum("bkmt,kmtx,bkmxp->btkp", coef, qk, h0)


PUBLIC = (naive_spectral_scan, spectral_scan)  # the nine-tensor signature of DESIGN.md


def inputs_of(fn, x) -> list:
    """Positional inputs of ``fn``: the nine tensors for the public ops; v, write, read, clock and one
    ``ModalTables`` for the package's own paths (chunked torch and fla scans)."""
    head = [x[n] for n in NAMES[:4]]
    return head + [x[n] for n in NAMES[4:9]] if fn in PUBLIC else head + [tables(x)]


def tables(x) -> ModalTables:
    return ModalTables(*(x[n] for n in NAMES[4:9]))


def run(fn, x, **kw):
    return fn(*inputs_of(fn, x), initial_state=x["initial_state"], output_final_state=True, **kw)


# (T, clock, strong mode): chunk-level, 16-level, mixed (factorised + pairwise) and pairwise plans all occur
CASES = [(1, 0.1, None), (63, 0.1, (1, 2, 30.0)), (64, 40.0, None), (65, 0.05, (0, 0, 50.0)),
         (130, 0.1, None), (300, 25.0, (2, 3, 50.0))]


@pytest.mark.parametrize("T,clock,strong", CASES)
@pytest.mark.parametrize("tiny_rho", [False, True])
def test_forward_matches_spec_and_interaction_matrix(T, clock, strong, tiny_rho):
    x = make_inputs(T=T, clock=clock, strong=strong, tiny_rho=tiny_rho, seed=T)
    z_ref, h_ref = run(naive_spectral_scan, x)
    z_mat = interaction_form(x)
    assert (z_ref - z_mat).abs().max() < 1e-10
    for diagonal in ("auto", "pairwise"):
        z, h = run(chunk_spectral_scan, x, diagonal=diagonal)
        assert torch.isfinite(z).all() and torch.isfinite(h).all()
        assert (z - z_ref).abs().max() < 1e-10, diagonal
        assert (h - h_ref).abs().max() < 1e-10, diagonal
    z, h = run(spectral_scan, x, backend="torch", chunk_size=32)
    assert (z - z_ref).abs().max() < 1e-10 and (h - h_ref).abs().max() < 1e-10


def test_plans():
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    lim = ct._safe_exponent(F64)
    L = torch.cumsum(torch.full((1, 2, 3, 64, 2), 0.5, dtype=F64), -2)  # span 32 per chunk
    assert ct._plan(L, "auto", lim) == (64, None, "factorized")
    assert ct._plan(L * 30, "auto", lim) == (16, None, "factorized")  # span 960 per chunk, 240 per 16-block
    L[:, 1, :, :, 0] *= 100  # one mode too steep even for 16-blocks
    sub, keep, kind = ct._plan(L, "auto", lim)
    assert sub == 16 and kind == "mixed" and keep.sum() == 3 and not keep[1, 0]
    assert ct._plan(L, "pairwise", lim) == (16, None, "pairwise")
    assert ct._plan(L * 1e3, "auto", lim) == (16, None, "pairwise")  # no mode fits


def test_plan_inside_a_cuda_graph_capture_reads_no_data(monkeypatch):
    """Inside a CUDA-graph capture (the serving pools' graphed prefill) "auto" takes the pairwise plan, as under
    compile: choosing the factorised one reads the decays on the host, which a capture forbids."""
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    lim = ct._safe_exponent(F64)
    L = torch.cumsum(torch.full((1, 2, 3, 64, 2), 0.5, dtype=F64), -2)
    assert ct.host_sync_allowed(L)
    monkeypatch.setattr(ct, "host_sync_allowed", lambda x: False)
    assert ct._plan(L, "auto", lim) == (16, None, "pairwise")
    assert ct._plan(L, "factorized", lim) == (64, None, "factorized")


def test_decay_scan_recursion():
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    g = torch.Generator().manual_seed(2)
    ell = 3 * torch.rand(2, 3, 23, generator=g, dtype=F64)
    U, h = torch.randn(2, 3, 23, 4, generator=g, dtype=F64), torch.randn(2, 3, 4, generator=g, dtype=F64)
    states, last = ct._decay_scan(ell, U, h, group=4)  # three levels of groups
    for j in range(23):
        torch.testing.assert_close(states[..., j, :], h, atol=1e-13, rtol=0)
        h = torch.exp(-ell[..., j, None]) * h + U[..., j, :]
    torch.testing.assert_close(last, h, atol=1e-13, rtol=0)
    x = make_inputs(B=1, T=1100, K=2, M=3, P=3, clock=0.05)  # 69 chunks of 16: the chunk scan recurses
    z_ref, h_ref = run(naive_spectral_scan, x)
    z, h = run(chunk_spectral_scan, x, chunk_size=16)
    assert (z - z_ref).abs().max() < 1e-10 and (h - h_ref).abs().max() < 1e-10


def test_factorized_admission():
    x = make_inputs(T=100, clock=0.05)
    z_ref, h_ref = run(naive_spectral_scan, x)
    z, h = run(chunk_spectral_scan, x, diagonal="factorized")
    assert (z - z_ref).abs().max() < 1e-10 and (h - h_ref).abs().max() < 1e-10
    with pytest.raises(ValueError, match="factorized"):
        run(chunk_spectral_scan, make_inputs(T=100, clock=40.0), diagonal="factorized")


def test_float32_strong_clocks_stay_finite():
    x = make_inputs(B=1, T=200, clock=50.0, tiny_rho=True)
    x32 = {n: t.float().requires_grad_() for n, t in x.items()}
    z, h = run(chunk_spectral_scan, x32)
    (z.square().sum() + h.sum()).backward()
    assert torch.isfinite(z).all() and torch.isfinite(h).all()
    assert all(torch.isfinite(t.grad).all() for t in x32.values())
    z_ref, _ = run(naive_spectral_scan, x)
    assert (z.double() - z_ref).abs().max() < 1e-4 * z_ref.abs().max()


def _grads(fn, x, **kw):
    """Gradients of a test loss for every input; the rho gradient is reported as d/d(log rho) = rho d/d(rho)
    (the chunked path differentiates through log rho, so at rho = 1e-6 its d/d(rho) carries 1/rho)."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    z, h = run(fn, leaves, **kw)
    loss = (z * torch.cos(z)).sum() + (h * h.detach().sign()).sum()
    grads = list(torch.autograd.grad(loss, [leaves[n] for n in NAMES]))
    grads[4] = grads[4] * x["rho"]
    return grads


@pytest.mark.parametrize("clock,strong", [(0.1, None), (0.1, (1, 2, 40.0)), (30.0, None)])
def test_gradients_match_spec(clock, strong):
    x = make_inputs(T=70, clock=clock, strong=strong, tiny_rho=True)
    ref = _grads(naive_spectral_scan, x)
    for diagonal in ("auto", "pairwise"):
        for name, g, r in zip(NAMES, _grads(chunk_spectral_scan, x, diagonal=diagonal), ref):
            assert torch.isfinite(g).all(), name
            assert (g - r).abs().max() <= 1e-9 * max(1.0, r.abs().max().item()), (diagonal, name)


@pytest.mark.parametrize("diagonal,clock", [("factorized", 0.3), ("pairwise", 0.3), ("auto", 30.0)])
def test_gradcheck(diagonal, clock):
    strong = (0, 1, 40.0) if diagonal == "auto" else None
    x = make_inputs(B=1, T=20, K=2, M=2, P=2, clock=clock, strong=strong)
    leaves = [x[n].clone().requires_grad_() for n in NAMES]

    def f(*args):
        return chunk_spectral_scan(*args[:4], ModalTables(*args[4:9]), initial_state=args[9],
                                   output_final_state=True, chunk_size=16, diagonal=diagonal)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


def test_pairwise_block_backward():
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    g = torch.Generator().manual_seed(1)
    lq = torch.cumsum(torch.rand(1, 3, 1, 2, 5, generator=g, dtype=F64), -1).requires_grad_()
    r, w = (torch.rand(1, 3, 1, 2, 5, generator=g, dtype=F64).requires_grad_() for _ in range(2))
    psi = torch.tril(torch.randn(3, 5, 5, generator=g, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(ct._PairwiseDiagonal.apply, (lq, r, w, psi))


def test_decode_steps_equal_scan():
    x = make_inputs(T=67, clock=0.3, strong=(1, 0, 30.0))
    z_ref, h_ref = run(chunk_spectral_scan, x)
    state = x["initial_state"].clone()
    zs = []
    for t in range(x["v"].shape[1]):
        args = [x[n][:, t] for n in ("v", "write", "read", "clock")]
        z_t, out = spectral_scan_step(*args, tables(x), state)
        assert out is state
        zs.append(z_t)
    assert (torch.stack(zs, 1) - z_ref).abs().max() < 1e-10
    assert (state - h_ref).abs().max() < 1e-10


def test_channel_prefix_consistency():
    x = make_inputs(K=5, T=90, clock=0.2)
    z, h = run(spectral_scan, x, backend="torch")
    Kp = 3
    cut = lambda n, t: t[:Kp] if n in NAMES[4:9] else t[:, :, :Kp] if t.dim() == 4 else t[:, :Kp]  # noqa: E731
    xp = {n: cut(n, t) for n, t in x.items()}
    zp, hp = run(spectral_scan, xp, backend="torch")
    torch.testing.assert_close(zp, z[:, :, :Kp], atol=1e-13, rtol=0)
    torch.testing.assert_close(hp, h[:, :Kp], atol=1e-13, rtol=0)


def test_no_state_and_empty_sequence():
    x = make_inputs(T=10)
    z, h = spectral_scan(*(x[n] for n in NAMES[:9]))
    z_ref, _ = naive_spectral_scan(*(x[n] for n in NAMES[:9]))
    assert h is None and (z - z_ref).abs().max() < 1e-12
    x0 = make_inputs(T=0)
    z, h = run(spectral_scan, x0)
    assert z.shape == (2, 0, 3, 5) and torch.equal(h, x0["initial_state"])


def test_half_precision_inputs_on_cpu():
    x = make_inputs(T=40)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    z, h = run(spectral_scan, xb, backend="torch")
    assert z.dtype == torch.bfloat16 and h.dtype == torch.float32
    z_ref, _ = run(naive_spectral_scan, {n: t.double() for n, t in xb.items()})
    assert (z.double() - z_ref).abs().max() < 2e-2 * z_ref.abs().max()


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_torch_path_under_bf16_autocast_computes_in_float32(in_dtype):
    """Autocast does not reach the torch scan (training under ``--train.precision bf16`` without fla): a mixed
    plan (one mode pairwise, Eq. 27) gives, forward and backward, what it gives without autocast."""
    x = make_inputs(T=70, strong=(1, 2, 30.0), seed=3)
    ct = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_torch")
    L = torch.cumsum(x["clock"] - torch.log(x["rho"]), 1).permute(0, 2, 1, 3).reshape(2, 3, 1, 70, 4)
    assert ct._plan(L[:, :, :, :64], "auto", ct._safe_exponent(torch.float32))[2] == "mixed"

    def grads(autocast):
        xs = {n: t.to(in_dtype if n in NAMES[:4] else torch.float32).requires_grad_() for n, t in x.items()}
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            z, h = run(spectral_scan, xs, backend="torch")
        (z.float().square().sum() + h.square().sum()).backward()
        return [z, h] + [xs[n].grad for n in NAMES]

    for a, b in zip(grads(True), grads(False), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_dispatch(monkeypatch, caplog):
    t = torch.zeros(1)
    assert resolve_backend("auto", t) == "torch"
    assert resolve_backend("naive", t) == "naive"
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "naive")
    assert resolve_backend("auto", t) == "naive"
    assert resolve_backend("torch", t) == "torch"  # the argument wins over the environment
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ELASTIC_SSM_SCAN_BACKEND"):
        resolve_backend("auto", t)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("fla", t)
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("cuda", t)
    assert es.ops.spectral_scan is spectral_scan
    assert logging.getLogger("elastic_ssm").name == "elastic_ssm"


BAD = [
    (lambda x: x.update(v=x["v"][0]), "v must be a \\[B, T, K, P\\]"),
    (lambda x: x.update(write=x["write"][:, :, :2]), "write must be"),
    (lambda x: x.update(clock=x["clock"][..., :3]), "write, read and clock must share one shape"),
    (lambda x: x.update(write=x["write"][..., :3]), "got write \\[2, 5, 3, 3\\], read \\[2, 5, 3, 4\\]"),
    (lambda x: x.update(rho=x["rho"][:2]), "rho must be \\[K, M\\] = \\[3, 4\\]"),
    (lambda x: x.update(a=x["a"][None]), "a must be"),
    (lambda x: x.update(initial_state=x["initial_state"][..., :4]), "initial_state must be"),
    (lambda x: x.update(theta=x["theta"].to("meta")), "one device"),
    (lambda x: x.update(read=x["read"].long()), "floating point"),
]


@pytest.mark.parametrize("mutate,msg", BAD)
@pytest.mark.parametrize("fn", [spectral_scan, naive_spectral_scan])
def test_bad_inputs(mutate, msg, fn):
    x = make_inputs(T=5)
    mutate(x)
    with pytest.raises(ValueError, match=msg):
        run(fn, x)


def test_an_empty_batch_scans_to_empty_outputs():
    """B = 0 (the chunked path reduces over the batch): empty z and state of the right shapes, as the spec gives."""
    x = {k: v[:0] if v.dim() >= 4 else v for k, v in make_inputs(T=5).items()}
    for fn in (spectral_scan, naive_spectral_scan):
        z, state = run(fn, x)
        assert z.shape == (0, 5, 3, x["v"].shape[-1]) and state.shape == (0, *x["initial_state"].shape[1:])


def test_bad_step_inputs():
    x = make_inputs(T=2)
    args = [x[n][:, 0] for n in ("v", "write", "read", "clock")]
    with pytest.raises(ValueError, match="state must be"):
        spectral_scan_step(*args, tables(x), x["initial_state"][:, :2])
    with pytest.raises(ValueError, match="read_t and clock_t must share one shape"):
        spectral_scan_step(*args[:3], args[3][..., :2], tables(x), x["initial_state"].clone())
    with pytest.raises(ValueError, match="rho must be"):
        spectral_scan_step(*args, tables(x)._replace(rho=x["rho"][:2]), x["initial_state"].clone())
