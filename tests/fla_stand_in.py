"""A CPU stand-in for fla-core's ``fla.ops.gla.chunk`` (``chunk_gla_fwd`` / ``chunk_gla_bwd``), for tests.

It follows the conventions the custom ops of ``elastic_ssm/ops/spectral_scan/chunk_fla.py`` rely on: the forward
returns ``(g_cumsum, A, h, ht, o)`` with ``g_cumsum`` the within-chunk cumulative gate in log2 units
(fla's ``chunk_local_cumsum(g, C, scale=1/ln 2)``) and ``A [B, T, H, C]`` float32; the backward gets
``g=None`` and that ``g_cumsum`` (float32 gates), recomputes the states (``h=None``) and returns the
gradients ``dq, dk, dv, dg, dh0``. The math is a float64 tokenwise recurrence; the backward is its ``torch.func.vjp``.
``install(monkeypatch)`` puts the stand-in into ``sys.modules`` and returns a dict of call records.

Non-finite inputs: fla's forward evaluates each chunk as ``A @ V`` with a causally masked ``A`` (in
``chunk_gla_fwd_kernel_o``), so a NaN/Inf value at position s reaches every earlier row of its chunk as
``0 * NaN``. The stand-in reproduces the worst case of that: any non-finite ``q, k, v`` or ``g`` in a chunk of
a head makes that whole chunk of the head's output NaN (the recurrence already carries it to later chunks).
"""

import math
import sys
import types

import torch


def naive_gla(q, k, v, g, h0, scale=1.0):
    """Tokenwise GLA: S_t = diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t. [B, T, H, D]."""
    S = h0.clone()
    outs = []
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhd,bhdp->bhp", q[:, t] * scale, S))
    return torch.stack(outs, 1), S


def _local_cumsum(g, C):
    B, T, H, D = g.shape
    n = -(-T // C)
    pad = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, n * C - T))
    return pad.reshape(B, n, C, H, D).cumsum(2).reshape(B, n * C, H, D)[:, :T] / math.log(2)


def _gate_from_cumsum(gc, C):
    g = gc * math.log(2)
    prev = torch.nn.functional.pad(g[:, :-1], (0, 0, 0, 0, 1, 0))
    first = (torch.arange(g.shape[1]) % C == 0)[None, :, None, None]
    return torch.where(first, g, g - prev)


def _poison_chunks(o, inputs, C):
    """NaN over every (chunk, head) of ``o [B, T, H, V]`` whose inputs hold a non-finite entry (see above)."""
    B, T, H, _ = o.shape
    n = -(-T // C)
    bad = torch.zeros(B, n * C, H, dtype=torch.bool)
    for x in inputs:
        bad[:, :T] |= ~torch.isfinite(x).all(-1)
    bad = bad.reshape(B, n, C, H).any(2, keepdim=True).expand(B, n, C, H).reshape(B, n * C, H)[:, :T]
    return o.masked_fill(bad[..., None], math.nan)


def _state0(q, v, h0):
    B, _, H, Dk = q.shape
    return torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double()


def install(monkeypatch) -> dict:
    calls = {"fwd": 0, "bwd": 0}

    def chunk_gla_fwd(q, k, v, g, g_cumsum, scale, initial_state, output_final_state, cu_seqlens=None,
                      chunk_size=64, chunk_indices=None):
        assert g.dtype == torch.float32 and cu_seqlens is None
        if g_cumsum is not None:                 # given (chunk_fla.local_cumsum_log2): must be fla's own
            assert g_cumsum.dtype == torch.float32 and g_cumsum.shape == g.shape
            assert torch.allclose(g_cumsum.double(), _local_cumsum(g.double(), chunk_size), rtol=1e-5, atol=1e-5)
            calls["given_cumsum"] = calls.get("given_cumsum", 0) + 1
        assert all(x.is_contiguous() for x in (q, k, v, g))
        calls["fwd"] += 1
        calls["chunk_size"] = chunk_size
        calls["heads"], calls["widths"], calls["batch_length"] = q.shape[2], (q.shape[3], v.shape[3]), q.shape[:2]
        assert min(q.shape[3], v.shape[3]) >= 16, "fla-core 0.6.0's backward needs Dk, Dv >= 16 (tl.dot)"
        o, S = naive_gla(q.double(), k.double(), v.double(), g.double(), _state0(q, v, initial_state), scale)
        B, T, H, _ = q.shape
        o = _poison_chunks(o, (q, k, v, g), chunk_size)
        A = torch.full((B, T, H, chunk_size), 7.0, dtype=torch.float32)
        gc = _local_cumsum(g, chunk_size).float() if g_cumsum is None else g_cumsum
        return (gc, A, None, S.float() if output_final_state else None,
                o.to(v.dtype))

    def chunk_gla_bwd(q, k, v, g, g_cumsum, scale, initial_state, h, A, do, dht, cu_seqlens=None,
                      chunk_size=64, chunk_indices=None):
        assert g is None and h is None and g_cumsum.dtype == torch.float32
        assert A.shape == (*q.shape[:3], chunk_size) and bool((A == 7.0).all())
        assert min(q.shape[3], v.shape[3]) >= 16, "fla-core 0.6.0's backward needs Dk, Dv >= 16 (tl.dot)"
        calls["bwd"] += 1
        # Custom-op kernels run below autograd, so the stand-in differentiates with torch.func.
        leaves = [x.double() for x in (q, k, v)]
        gl = _gate_from_cumsum(g_cumsum.double(), chunk_size)
        (_, _), vjp = torch.func.vjp(lambda *a: naive_gla(*a, scale), *leaves, gl, _state0(q, v, initial_state))
        dS = torch.zeros(*q.shape[:1], *q.shape[2:], v.shape[-1], dtype=torch.float64) if dht is None else dht
        dq, dk, dv, dg, dh0 = vjp((do.double(), dS.double()))
        return dq.float(), dk.float(), dv.to(do.dtype), dg.float(), None if initial_state is None else dh0.float()

    chunk = types.ModuleType("fla.ops.gla.chunk")
    chunk.chunk_gla_fwd, chunk.chunk_gla_bwd = chunk_gla_fwd, chunk_gla_bwd
    gla = types.ModuleType("fla.ops.gla")
    gla.chunk = chunk
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["fla.ops"].gla = gla
    monkeypatch.setitem(sys.modules, "fla.ops.gla", gla)
    monkeypatch.setitem(sys.modules, "fla.ops.gla.chunk", chunk)
    return calls
