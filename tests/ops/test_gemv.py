"""Fused small-batch products of the decode step (``ops.gemv``): the torch path against plain float64
math, the Triton kernels (CPU interpreter) against the torch path, and ``FastDecoder`` on both its
product paths against ``ESSH.step``."""

import copy

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

import elastic_ssm as es
from elastic_ssm.layers.decode_plan import FFNPlan, SpectralPlan
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import FastDecoder
from elastic_ssm.ops import gemv


def _rms(x, g, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def test_torch_path_equals_float64_math():
    torch.manual_seed(0)
    x, g = torch.randn(3, 40, dtype=torch.float64), torch.rand(40, dtype=torch.float64) + 0.5
    w, w2 = torch.randn(24, 40, dtype=torch.float64), torch.randn(2 * 24, 40, dtype=torch.float64)
    torch.testing.assert_close(gemv.norm_gemv(x, w, g, backend="torch"), _rms(x, g) @ w.T)
    torch.testing.assert_close(gemv.norm_gemv(x, w, None, backend="torch"), x @ w.T)
    h = _rms(x, g) @ w2.T
    torch.testing.assert_close(gemv.norm_swiglu_gemv(x, w2, g, backend="torch"),
                               F.silu(h[:, 0::2]) * h[:, 1::2])
    res = torch.randn(3, 24, dtype=torch.float64)
    want = res + x @ w.T
    gemv.norm_gemv(x, w, out=res, residual=True, backend="torch")
    torch.testing.assert_close(res, want)
    a, wo, acc = torch.randn(3, 24, dtype=torch.float64), torch.randn(24, 40, dtype=torch.float64), x.clone()
    torch.testing.assert_close(gemv.gemv_accumulate(a, wo, acc, 0.5, backend="torch"), x + 0.5 * a @ wo)


def test_bad_shapes_are_named():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="same D"):
        gemv.norm_gemv(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="must be given and differ from x"):
        gemv.norm_gemv(x, torch.randn(8, 8), out=x, residual=True)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.norm_swiglu_gemv(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match="unit stride"):
        gemv.norm_gemv(x, torch.randn(8, 4).T)
    with pytest.raises(ValueError, match="a \\[B, N\\], w \\[N, D\\], x \\[B, D\\]"):
        gemv.gemv_accumulate(torch.randn(2, 3), torch.randn(4, 8), x)
    with pytest.raises(ValueError, match="float32/64"):
        gemv.gemv_accumulate(torch.randn(2, 4), torch.randn(4, 8), x.half())


_INTERPRETER_CHECK = """
import copy
import torch
import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import FastDecoder
from elastic_ssm.ops import gemv

torch.manual_seed(0)
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
worst = 0.0
for B in (1, 3, 8):
    for N, D in ((40, 96), (130, 64)):
        x, g = torch.randn(B, D), torch.rand(D) + 0.5
        w, w2, wo = torch.randn(N, D).bfloat16(), torch.randn(2 * N, D).bfloat16(), torch.randn(N, D).bfloat16()
        for norm in (g, None):
            for bk in (None, 32):   # one column tile (the default here) and several (the loop after the first)
                worst = max(worst, rel(gemv.norm_gemv(x, w, norm, backend="triton", block_k=bk),
                                       gemv.norm_gemv(x, w, norm, backend="torch")))
        for bk in (None, 32):
            worst = max(worst, rel(gemv.norm_swiglu_gemv(x, w2, g, backend="triton", block_k=bk),
                                   gemv.norm_swiglu_gemv(x, w2, g, backend="torch")))
        r1, r2 = torch.randn(B, N), None
        r2 = r1.clone()
        gemv.norm_gemv(x, w, out=r1, residual=True, backend="triton")
        gemv.norm_gemv(x, w, out=r2, residual=True, backend="torch")
        worst = max(worst, rel(r1, r2))
        a = torch.randn(B, N)
        for split, bn in ((None, None), (3, 8), (1, 16)):
            x1, x2 = torch.randn(B, D), None
            x2 = x1.clone()
            gemv.gemv_accumulate(a, wo, x1, 0.3, backend="triton", split=split, block_n=bn)
            gemv.gemv_accumulate(a, wo, x2, 0.3, backend="torch")
            worst = max(worst, rel(x1, x2))
assert worst < 1e-6, worst

cfg = es.ESSHConfig.preset("tiny")
model = randomize_selective(es.ESSH(cfg).eval(), ffn_out_std=0.1, zero_lag=True)
ids = torch.randint(0, cfg.vocab_size, (2, 20))
ref = model.allocate_cache(2, "T2", state_dtype=torch.float32, kv_dtype=torch.float32)
with torch.no_grad():
    model(ids, tier="T2", cache=ref)
decoders = [FastDecoder(model, "T2", 2, cache=copy.deepcopy(ref), backend="triton", out_layout=lay)
            for lay in ("split", "rows")]
assert all(fd.fused_gemv for fd in decoders)
tok = ids[:, -1]
for _ in range(4):
    want = model.step(tok, ref)
    for fd in decoders:
        err = rel(fd.step(tok), want)
        assert err < 1e-5, err
    tok = want.argmax(-1)
print("ok")
"""


def test_triton_kernels_in_interpreter():
    """The Triton products and a fused FastDecoder on CPU tensors (TRITON_INTERPRET=1 before import)."""
    run_interpreted(_INTERPRETER_CHECK)


@pytest.mark.parametrize("batch,out_layout", [(2, "split"), (2, "rows"), (9, "split")])
def test_fast_decoder_product_paths_agree(batch, out_layout):
    """``gemv='auto'`` picks the fused path up to MAX_FUSED_BATCH and cuBLAS-style products above; both
    equal ``ESSH.step`` (fp32 model, ring buffer wrapped)."""
    torch.manual_seed(1)
    cfg = es.ESSHConfig.preset("tiny")
    model = randomize_selective(es.ESSH(cfg).eval(), ffn_out_std=0.1, zero_lag=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, 20))
    ref = model.allocate_cache(batch, None, state_dtype=torch.float32, kv_dtype=torch.float32)
    with torch.no_grad():
        model(ids, cache=ref)
    auto = FastDecoder(model, None, batch, cache=copy.deepcopy(ref), backend="torch", out_layout=out_layout)
    assert auto.fused_gemv == (batch <= gemv.MAX_FUSED_BATCH)
    copies = [p.w_out_split for p in auto.ffns + auto.mixers if getattr(p, "w_out_split", None) is not None]
    n_split = sum(isinstance(p, (FFNPlan, SpectralPlan)) for p in auto.ffns + auto.mixers)
    assert len(copies) == (n_split if auto.fused_gemv and out_layout == "split" else 0)
    other = FastDecoder(model, None, batch, cache=copy.deepcopy(ref), backend="torch",
                        gemv="cublas" if auto.fused_gemv else "fused")
    tok = ids[:, -1]
    for _ in range(5):
        want = model.step(tok, ref)
        for fd in (auto, other):
            got = fd.step(tok)
            assert ((got - want).norm() / want.norm()).item() < 1e-5
        tok = want.argmax(-1)
    with pytest.raises(ValueError, match="gemv must be"):
        FastDecoder(model, None, batch, gemv="cutlass")
    with pytest.raises(ValueError, match="out_layout must be"):
        FastDecoder(model, None, batch, out_layout="cols")


def test_programmatic_dependent_launch_is_off_where_unsupported(monkeypatch):
    """PDL (ops/gemv) is a CUDA Hopper feature: 'auto' resolves to off on CPU and in the interpreter,
    forcing it there is a clear error, and FastDecoder follows the same rule."""
    import elastic_ssm as es
    from elastic_ssm.models.fast_decode import FastDecoder
    from elastic_ssm.ops.gemv import pdl_supported, resolve_pdl

    assert not pdl_supported("cpu") and resolve_pdl("auto", "cpu") is False and resolve_pdl(False, "cpu") is False
    with pytest.raises(ValueError, match="compute capability"):
        resolve_pdl(True, "cpu")
    with pytest.raises(ValueError, match="pdl must be"):
        resolve_pdl("yes", "cpu")
    monkeypatch.setenv("ELASTIC_SSM_PDL", "0")
    assert not pdl_supported("cpu")
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    assert FastDecoder(model, "T2", 1).pdl is False
    with pytest.raises(ValueError, match="compute capability"):
        FastDecoder(model, "T2", 1, pdl=True)
