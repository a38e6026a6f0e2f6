"""Edge values of the ESSH scan (Eq. 5, 24) against the float64 tokenwise specification (naive.py).

Both chunked paths (torch, and fla through its CPU stand-in ``fla_stand_in.py``, which spreads a non-finite
input over its whole chunk as fla's ``A @ V`` does) must be causal and finite wherever the spec is: a NaN/Inf
at position t leaves every output before t (and every other channel) finite and equal to the spec;
``rho = 0`` and an infinite clock are the spec's finite state reset; clocks far above the reset exponent are
exact; ``rho = exp(-softplus(x))`` of a large ``x`` (underflow to 0 inside the model) keeps the logits finite.
The public op rejects values outside its ranges (negative clock, rho outside [0, 1], non-finite modal
tables) eagerly, and under ``torch.compile`` turns them into NaN outputs without a graph break.
The same cases for the real fla kernels: ``tests/ops/test_spectral_scan_gpu.py -k edge``.
"""

import importlib
import math

import fla_stand_in
import pytest
import torch
from test_spectral_scan import _grads, make_inputs, tables
from test_spectral_scan_fla import naive_gla

import elastic_ssm as es
from elastic_ssm.ops import chunk_spectral_scan, naive_spectral_scan, spectral_scan
from elastic_ssm.ops.spectral_scan.chunk_fla import gla_inputs, gla_outputs

ARGS = ("v", "write", "read", "clock", "rho", "theta", "kc", "ks", "a")


def _both(x, dtype=torch.float64, chunk=16):
    spec = naive_spectral_scan(*(x[n] for n in ARGS), initial_state=x["initial_state"], output_final_state=True)
    fast = chunk_spectral_scan(*(x[n].to(dtype) for n in ARGS[:4]), tables(x).to(dtype),
                               initial_state=x["initial_state"].to(dtype),
                               output_final_state=True, chunk_size=chunk)
    return spec, fast


def _agree_where_finite(spec, fast, atol=1e-9, rtol=1e-7):
    """Same finiteness pattern-or-better, equal values wherever the spec is finite."""
    for s, f in zip(spec, fast):
        fin = torch.isfinite(s)
        assert torch.isfinite(f[fin]).all(), "the fast path is non-finite where the spec is finite"
        torch.testing.assert_close(f[fin].double(), s[fin], rtol=rtol, atol=atol)


def _fla(monkeypatch, x):
    """The fla path on CPU (stand-in kernel) in float32, and the float64 spec of the same float32 values."""
    fla_stand_in.install(monkeypatch)
    fla_spectral_scan = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla").fla_spectral_scan
    x32 = {n: t.float() for n, t in x.items()}
    fast = fla_spectral_scan(*(x32[n] for n in ARGS[:4]), tables(x32), initial_state=x32["initial_state"],
                             output_final_state=True)
    spec = naive_spectral_scan(*(x32[n].double() for n in ARGS), initial_state=x32["initial_state"].double(),
                               output_final_state=True)
    return spec, fast


def _set_bad(x, where, bad, t0, k):
    if where == "initial_state":
        x[where][1, k, 2, 0, 0] = bad
    elif where == "v":
        x[where][1, t0, k, 3] = bad
    else:
        x[where][1, t0, k, 2] = bad


@pytest.mark.parametrize("where", ["v", "write", "clock", "read", "initial_state"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_input_does_not_reach_earlier_positions(where, bad):
    x = make_inputs(B=2, T=70, K=3, M=4, P=5, seed=1)
    t0, k = 37, 1
    _set_bad(x, where, bad, t0, k)
    spec, fast = _both(x)
    _agree_where_finite(spec, fast)
    z = fast[0]
    assert torch.isfinite(z[0]).all() and torch.isfinite(z[1, :, [0, 2]]).all()  # other rows and channels
    if where != "initial_state":
        assert torch.isfinite(z[1, :t0]).all()  # causal: nothing before t0 is touched
    if where == "clock" and bad == math.inf:  # an infinite clock is a reset, finite everywhere
        assert torch.isfinite(spec[0]).all() and torch.isfinite(z).all()
    else:
        assert not torch.isfinite(z[1, t0 if where != "initial_state" else 0, k]).all()


@pytest.mark.parametrize("where", ["v", "write", "clock", "read", "initial_state"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_fla_path_keeps_nonfinite_inputs_where_the_spec_does(monkeypatch, where, bad):
    """The fla wrapper isolates a bad position from the kernel's chunk (the stand-in would NaN all of it)."""
    x = make_inputs(B=2, T=70, K=3, M=4, P=5, seed=1)
    t0, k = 37, 1
    _set_bad(x, where, bad, t0, k)
    spec, fast = _fla(monkeypatch, x)
    _agree_where_finite(spec, fast, atol=1e-5, rtol=1e-5)
    z = fast[0]
    if where != "initial_state":
        assert torch.isfinite(z[1, :t0]).all()  # positions 0..36 share the bad position's chunk (0..63)
    if where == "clock" and bad == math.inf:
        assert torch.isfinite(z).all() and torch.isfinite(fast[1]).all()
    else:
        assert not torch.isfinite(z[1, t0 if where != "initial_state" else 0, k]).all()
        assert torch.isfinite(fast[1][0]).all()  # the other row's final state
        assert torch.isfinite(fast[1][1, k]).all() == (where == "read")  # a read gate does not enter the state


def test_stand_in_kernel_spreads_a_nan_over_its_chunk(monkeypatch):
    """What the wrapper guards against: the raw kernel (custom op) NaNs the earlier rows of the chunk."""
    fla_stand_in.install(monkeypatch)
    from elastic_ssm.ops.spectral_scan.chunk_fla import gla_chunk

    q, k, v = (torch.randn(1, 70, 2, 4) for _ in range(3))
    v[0, 37, 1, 0] = math.nan
    o, _ = gla_chunk(q, k, v, torch.full((1, 70, 2, 4), -0.1))
    assert not torch.isfinite(o[0, :64, 1]).any() and torch.isfinite(o[0, :, 0]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_rho_and_infinite_clock_are_finite_resets(dtype):
    x = make_inputs(B=2, T=130, K=3, M=4, P=5, seed=2)
    x["rho"][0, 1] = 0.0
    x["clock"][0, 5, 2, 3] = math.inf
    x["clock"][1, 64:, 1, 0] = math.inf  # a chunk boundary, every position after it
    spec, fast = _both(x, dtype, chunk=64)
    assert all(torch.isfinite(s).all() for s in spec)
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    for s, f in zip(spec, fast):
        assert torch.isfinite(f).all()
        torch.testing.assert_close(f.double(), s, rtol=tol, atol=tol)


def _reset_inputs():
    x = make_inputs(B=2, T=130, K=3, M=4, P=5, seed=2)
    x["rho"][0, 1] = 0.0
    x["clock"][0, 5, 2, 3] = math.inf
    x["clock"][1, 64:, 1, 0] = math.inf
    return x


@pytest.mark.parametrize("path", ["torch", "fla"])
def test_resets_have_the_spec_gradients(monkeypatch, path):
    """Gradients through rho = 0 and infinite clocks are finite and the spec's (rho's as rho dL/drho, what a
    softplus-parameterised rho receives: 0 at rho = 0); no 0 * inf from log rho or the cap."""
    x = _reset_inputs()
    if path == "fla":
        fla_stand_in.install(monkeypatch)
        fn = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla").fla_spectral_scan
        x, tol = {n: t.float().double() for n, t in x.items()}, 1e-4
        def run_fn(*a, initial_state, output_final_state):  # float32 inputs (ModalTables.to as well)
            return fn(*(t.to(torch.float32) for t in a), initial_state=initial_state.float(),
                      output_final_state=output_final_state)
    else:
        run_fn, tol = lambda *a, **kw: chunk_spectral_scan(*a, chunk_size=64, **kw), 1e-9  # noqa: E731
    for name, g, r in zip(ARGS + ("initial_state",), _grads(run_fn, x), _grads(naive_spectral_scan, x)):
        assert torch.isfinite(g).all(), name
        assert (g.double() - r).abs().max() <= tol * max(1.0, r.abs().max().item()), name


def test_fla_path_resets_finitely(monkeypatch):
    spec, fast = _fla(monkeypatch, _reset_inputs())
    for s, f in zip(spec, fast):
        assert torch.isfinite(s).all() and torch.isfinite(f).all()
        torch.testing.assert_close(f.double(), s, rtol=2e-5, atol=2e-5)


def test_gla_mapping_of_the_fla_path_resets_finitely():
    """The fla path's forget gate g = log rho - Delta is capped the same way (no -inf, so no NaN)."""
    x = make_inputs(B=1, T=20, K=2, M=3, P=4, seed=5)
    x["rho"][0, 1] = 0.0
    x["clock"][0, 7, 1, 2] = math.inf
    q, k, v, g, h0 = gla_inputs(*(x[n] for n in ARGS[:4]), tables(x), initial_state=x["initial_state"])
    assert torch.isfinite(g).all()
    z, h = gla_outputs(*naive_gla(q, k, v, g, h0), x["v"], x["write"], x["read"], tables(x))
    z_ref, h_ref = naive_spectral_scan(*(x[n] for n in ARGS), initial_state=x["initial_state"],
                                       output_final_state=True)
    torch.testing.assert_close(z, z_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(h, h_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
@pytest.mark.parametrize("size", [1e2, 1e4, 1e6, 1e30])
def test_isolated_large_clocks_stay_accurate(dtype, tol, size):
    """Accurate clock range: any clock >= 0 (above ~105 in fp32 / ~746 in fp64 a clock is an exact reset)."""
    x = make_inputs(B=1, T=130, K=2, M=3, P=4, seed=3)
    for t in (3, 40, 64, 100):
        x["clock"][0, t, t % 2, t % 3] = size
    spec, fast = _both(x, dtype, chunk=64)
    for s, f in zip(spec, fast):
        torch.testing.assert_close(f.double(), s, rtol=tol, atol=tol)


def test_nan_input_keeps_gradients_of_earlier_positions_finite():
    x = make_inputs(B=1, T=40, K=2, M=3, P=4, seed=4)
    x["v"][0, 30, 0, 0] = math.nan
    v = x["v"].clone().requires_grad_(True)
    z, _ = chunk_spectral_scan(v, *(x[n] for n in ARGS[1:4]), tables(x), chunk_size=16)
    z[0, :30].sum().backward()
    assert torch.isfinite(v.grad).all()


def test_large_rho_raw_keeps_the_model_finite():
    """rho = exp(-softplus(rho_raw)) underflows to 0 at rho_raw >~ 104: a reset, not NaN logits or gradients."""
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    mixer = next(b.mixer for b in model.blocks if b.kind == "S")
    with torch.no_grad():
        mixer.rho_raw[0, 0] = 120.0
        mixer.rho_raw[1, :] = 1e4
    ids = torch.randint(0, 256, (2, 40))
    logits = model(ids)
    assert torch.isfinite(logits).all()
    logits.sum().backward()  # the gradient of an underflowed rho is 0, not 0 * inf = NaN
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert mixer.rho_raw.grad[1].abs().max() == 0 and mixer.rho_raw.grad[0, 1:].abs().max() > 0


@pytest.mark.parametrize("name,value,match", [
    ("clock", -1e-3, "clock must be >= 0"), ("rho", 1.5, "rho must lie in"), ("rho", -0.1, "rho must lie in"),
    ("rho", math.nan, "rho must lie in"), ("theta", math.inf, "theta must be finite"),
])
def test_public_op_checks_value_ranges(name, value, match):
    x = make_inputs(B=1, T=8, K=2, M=3, P=4)
    x[name].view(-1)[0] = value
    with pytest.raises(ValueError, match=match):
        spectral_scan(*(x[n] for n in ARGS), backend="torch")
    x = make_inputs(B=1, T=8, K=2, M=3, P=4)
    x["clock"][0, 3, 0, 0] = math.nan  # NaN is not a range error: it propagates as in the spec
    z, _ = spectral_scan(*(x[n] for n in ARGS), backend="torch")
    assert torch.isfinite(z[0, :3]).all() and not torch.isfinite(z[0, 3, 0]).all()


def test_public_op_under_compile_keeps_values_and_marks_bad_ranges():
    """``torch.compile(fullgraph=True)`` of a caller of the public op (``aot_eager``: dynamo capture and
    functionalisation; inductor's C++ build takes ~20 s here, the model's inductor forward is in
    test_compile.py): no graph break from the range checks,
    the same values as eager (also through resets), and an out-of-range clock or rho gives NaN in its channel
    where eager raises, never a plausible number."""
    x = make_inputs(B=1, T=20, K=3, M=3, P=4, seed=6)
    x["rho"][0, 1] = 0.0
    x["clock"][0, 5, 1, 2] = math.inf

    def scan(*args):
        return spectral_scan(*args[:9], initial_state=args[9], output_final_state=True, backend="torch")

    fn = torch.compile(scan, backend="aot_eager", fullgraph=True)
    args = [x[n] for n in ARGS] + [x["initial_state"]]
    for got, ref in zip(fn(*args), scan(*args)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    x["clock"][0, 9, 0, 1] = -0.5
    x["rho"][2, 0] = 1.5
    with pytest.raises(ValueError, match="clock must be >= 0"):
        scan(*args)
    z, h = fn(*args)
    assert not torch.isfinite(z[0, 9:, 0]).any() and not torch.isfinite(z[0, :, 2]).any()
    assert torch.isfinite(z[0, :, 1]).all() and torch.isfinite(h[0, 1]).all()


def test_sync_free_block_skips_the_isolation_and_a_nan_spoils_only_its_own_row(monkeypatch):
    """``sync_free`` (the serving pools' eager prefill) takes no host sync, as compiled and captured scans: the
    stand-in kernel NaNs the bad position's chunk in its own row and channel, and the other row's output and final
    state equal the checked scan's bit for bit. The block is per thread (a context variable)."""
    import threading

    from elastic_ssm.ops.spectral_scan.inputs import host_sync_allowed, isolating, sync_free

    x = make_inputs(B=2, T=70, K=3, M=4, P=5, seed=1)
    _set_bad(x, "v", math.nan, 37, 1)
    checked = _fla(monkeypatch, x)[1]
    seen = []
    with sync_free():
        assert not isolating(x["v"]) and host_sync_allowed(x["v"])   # the torch scan's plan may still read data
        other = threading.Thread(target=lambda: seen.append(isolating(x["v"])))
        other.start()
        other.join()
        free = _fla(monkeypatch, x)[1]
    assert seen == [True] and isolating(x["v"])
    assert torch.equal(free[0][0], checked[0][0]) and torch.equal(free[1][0], checked[1][0])
    assert torch.isfinite(checked[0][1, :37]).all() and not torch.isfinite(free[0][1, :37, 1]).any()
    assert torch.equal(free[0][1, :, [0, 2]], checked[0][1, :, [0, 2]])       # the bad row's other channels
