"""torch.compile of ESSH (``compile_model``), the fla custom ops under compile, and the flex sliding-window path.

CPU only. The whole-model checks use the ``aot_eager`` backend with ``fullgraph=True`` (dynamo capture,
functionalisation and the joint forward/backward graph, so any graph break or host sync fails the test)
and one inductor forward; inductor's C++ compile of the backward takes about a minute on a cold cache,
which the GPU script and tests (``tests/models/test_compile_gpu.py``) cover instead.
"""

import copy
import importlib
import os
import subprocess
import sys

import fla_stand_in
import pytest
import torch
import torch.nn.functional as F

import elastic_ssm as es
from elastic_ssm.layers import attention
from elastic_ssm.layers.attention import SlidingWindowAttention, flex_length, swa_block_mask, swa_flex, window_mask
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.ops import ModalTables

NAMES = ("v", "write", "read", "clock", "rho", "theta", "kc", "ks", "a", "initial_state")


def _tiny(T=40):
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny")), zero_lag=True)
    return model, torch.randint(0, model.config.vocab_size, (2, T))


def _grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kw)
    w = torch.linspace(-1, 1, logits.shape[-1])
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tier", [None, "T3"])
def test_compiled_essh_matches_eager_forward_and_grads(tier):
    """T = 40 > 2 windows: the blockwise SWA path, the chunked scan (pairwise plan under compile), SwiGLU."""
    model, ids = _tiny()
    ref, gref = _grads(model, ids, tier=tier)
    es.compile_model(model, backend="aot_eager", fullgraph=True)
    out, gout = _grads(model, ids, tier=tier)
    assert (out - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert gout.keys() == gref.keys() and len(gout) > 10
    for n, g in gref.items():
        assert (gout[n] - g).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding and a cache run eagerly / in their own graphs, unchanged
    with torch.no_grad():
        a = model(ids, tier=tier, attention_mask=mask)
        model.compile_forward(disable=True)
        b = model(ids, tier=tier, attention_mask=mask)
    assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


def test_deep_copy_of_a_compiled_model_uses_its_own_weights():
    model, ids = _tiny(T=12)
    es.compile_model(model, backend="aot_eager", fullgraph=True)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.norm_f.weight.mul_(2)
        a, b, ref = model(ids), twin(ids), twin.compile_forward(disable=True)(ids)
    assert "_compiled_trunk" in vars(model) and torch.allclose(b, ref, atol=1e-5) and not torch.allclose(a, b)


def test_compiled_first_call_traces_without_graph_breaks(monkeypatch):
    """Compiled before any eager call (as the benchmarks do): the backend choice is resolved and announced in
    the eager prologue, nothing is logged inside the graph (fullgraph would fail on a break)."""
    from elastic_ssm.ops import dispatch

    monkeypatch.setattr(dispatch, "_announced", set())
    model, ids = _tiny(T=12)
    es.compile_model(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = model(ids)
        ref = model.compile_forward(disable=True)(ids)
    assert ("torch", "cpu") in dispatch._announced and (out - ref).abs().max() < 1e-5


_INDUCTOR_SCALAR_CHECK = """
import torch
import torch._inductor.config as inductor_config
import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective

torch.manual_seed(0)
model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny")), zero_lag=True)
ids = torch.randint(0, model.config.vocab_size, (2, 24))
with torch.no_grad(), inductor_config.patch({"cpp.vec_isa_ok": False}):
    ref = model(ids)
    es.compile_model(model, fullgraph=True)
    out = model(ids)
err = (out - ref).abs().max().item()
assert err <= 1e-5 * max(1.0, ref.abs().max().item()), err
print("ok")
"""


def test_compiled_essh_inductor_forward(tmp_path):
    """Inductor's generated CPU code, scalar C++ (vectorised kernels double the cold compile time). It runs in
    a process of its own with its own inductor cache: turning the vector ISA off inside the test process
    left state behind that made a later process load a wrong artifact for the flex test below (max error
    2.7, torch 2.13 CPU)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, "-c", _INDUCTOR_SCALAR_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _scan_inputs(B=2, T=50, K=3, M=4, P=5):
    g = torch.Generator().manual_seed(3)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(v=rn(B, T, K, P), write=2 * torch.sigmoid(rn(B, T, K, M)), read=2 * torch.sigmoid(rn(B, T, K, M)),
                clock=F.softplus(rn(B, T, K, M) - 2), rho=0.5 + 0.49 * torch.rand(K, M, generator=g),
                theta=3 * rn(K, M).tanh(), kc=rn(K, M) / M, ks=rn(K, M) / M, a=torch.rand(K, M, generator=g),
                initial_state=rn(B, K, M, 2, P))


def test_fla_custom_ops_under_compile(monkeypatch):
    """The fla path traced whole (custom ops with fake kernels and registered autograd), forward and backward
    equal to eager, with a CPU stand-in for fla's kernels."""
    calls = fla_stand_in.install(monkeypatch)
    fla_spectral_scan = importlib.import_module("elastic_ssm.ops.spectral_scan.chunk_fla").fla_spectral_scan

    def run(fn, x):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        modal = ModalTables(*(leaves[n] for n in NAMES[4:9]))
        z, h = fn(*(leaves[n] for n in NAMES[:4]), modal, initial_state=leaves["initial_state"],
                  output_final_state=True)
        loss = (z * torch.linspace(-1, 1, z.shape[-1])).sum() + (h * h.detach().sign()).sum()
        return z.detach(), h.detach(), torch.autograd.grad(loss, [leaves[n] for n in NAMES])

    x = _scan_inputs()
    z0, h0, g0 = run(fla_spectral_scan, x)
    z1, h1, g1 = run(torch.compile(fla_spectral_scan, backend="aot_eager", fullgraph=True), x)
    assert calls["fwd"] == 2 and calls["bwd"] == 2 and calls["chunk_size"] == 64
    assert (z1 - z0).abs().max() < 1e-6 and (h1 - h0).abs().max() < 1e-6
    for n, a, b in zip(NAMES, g1, g0):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), n


def _implied_mask(bm, T, window):
    """The dense [T, T] mask a flex kernel applies for ``bm``: full tiles wholly, partial tiles through the band."""
    bs = bm.BLOCK_SIZE[0]
    nb = bm.kv_num_blocks.shape[-1]
    q = torch.arange(nb * bs)
    band = ((q[:, None] - q[None, :]) >= 0) & ((q[:, None] - q[None, :]) < window)
    tiles = torch.zeros(nb, nb, dtype=torch.int64)
    for i in range(nb):
        part = bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]]
        full = bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]]
        tiles[i, part] += 1
        tiles[i, full] += 2
    assert tiles.max() <= 2  # no tile is both
    t = tiles.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    return ((t == 2) | ((t == 1) & band))[:T, :T]


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("W,bs", [(16, 16), (24, 8), (16, 128)])
def test_swa_flex_equals_band_mask(W, bs):
    for T in (W + 1, 2 * W + 3, 5 * W):
        idx = torch.arange(T)
        bm = swa_block_mask(T, W, "cpu", bs)
        assert torch.equal(_implied_mask(bm, T, W), window_mask(idx, idx, W)[0, 0])
        q, k, v = (torch.randn(2, 3, T, 16, dtype=torch.float64) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(idx, idx, W))
        out = swa_flex(q, k, v, W, block_size=bs, compiled=False)
        assert (out - ref).abs().max() < 1e-12, (W, T)


def test_flex_length_buckets_to_powers_of_two():
    assert [flex_length(T, 128) for T in (1, 128, 129, 2049, 4096, 4097, 100_000)] == \
        [128, 128, 256, 4096, 4096, 8192, 131072]
    assert flex_length(17, 16) == 32


def test_padded_flex_backward_equals_the_band_mask(monkeypatch):
    """The zero padding up to ``flex_length`` changes no gradient: padded queries' outputs are dropped, so their
    (zero) output gradients give the real keys nothing (float64). flex has no CPU backward, so the band attention
    at the padded length is the masked SDPA here (on GPU: tests/models/test_compile_gpu.py)."""
    W, T, bs = 16, 37, 16

    def band_attention(q, k, v, block_mask):
        assert q.shape[-2] == flex_length(T, bs) == block_mask.seq_lengths[0]
        i = torch.arange(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(i, i, W))

    monkeypatch.setattr(attention, "flex_attention", band_attention)
    idx = torch.arange(T)
    leaves = [torch.randn(2, 3, T, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    dy = torch.randn(2, 3, T, 8, dtype=torch.float64)
    ref = torch.autograd.grad((F.scaled_dot_product_attention(*leaves, attn_mask=window_mask(idx, idx, W)) * dy)
                              .sum(), leaves)
    got = torch.autograd.grad((swa_flex(*leaves, W, block_size=bs, compiled=False) * dy).sum(), leaves)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < 1e-12


def test_compiled_flex_compiles_once_per_length_bucket():
    """Eleven prompt lengths between 40 and 120 compile two kernels (buckets 64 and 128), not eleven: before the
    buckets, the ninth length passed torch.compile's recompile limit and flex ran unfused with the whole [T, T]
    score matrix in memory."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for T in range(40, 121, 8):
        q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
        idx = torch.arange(T)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(idx, idx, 16))
        with torch.no_grad():
            assert (swa_flex(q, k, v, 16, block_size=16) - ref).abs().max() < 1e-5, T
    assert counters["stats"]["unique_graphs"] - before == 2


def test_flex_admits_a_bounded_number_of_shapes_then_the_masked_path(monkeypatch, caplog):
    """Past ``FLEX_MAX_SHAPES`` compiled shapes a new one is refused (the layer then takes the masked SDPA path)
    with one warning; shapes seen before, and lengths in a seen bucket, are still admitted."""
    monkeypatch.setattr(attention, "FLEX_MAX_SHAPES", 2)
    monkeypatch.setattr(attention, "_flex_shapes", set())
    monkeypatch.setattr(attention.flex_admits, "warned", False, raising=False)
    q = lambda B, T: torch.zeros(B, 2, T, 16)  # noqa: E731
    assert attention.flex_admits(q(1, 300)) and attention.flex_admits(q(1, 400))     # bucket 512, one shape
    assert attention.flex_admits(q(1, 600))                                          # bucket 1024
    with caplog.at_level("WARNING", logger="elastic_ssm"):
        assert not attention.flex_admits(q(2, 300)) and not attention.flex_admits(q(1, 3000))
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "masked SDPA path" in caplog.records[0].getMessage()
    assert attention.flex_admits(q(1, 500)) and attention.flex_admits(q(1, 1000))


def test_swa_kernel_switch_keeps_the_cpu_path(monkeypatch):
    """On CPU the layer keeps the masked SDPA path (the flex path is CUDA only), whatever ``SWA_KERNEL`` says."""
    attn = importlib.import_module("elastic_ssm.layers.attention")
    layer = SlidingWindowAttention(32, 16, 8).double()
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    pos = torch.arange(30).expand(2, 30)
    a = layer(x, pos)
    monkeypatch.setattr(attn, "SWA_KERNEL", "masked")
    assert torch.equal(a, layer(x, pos))


def test_swa_flex_block_mask_built_inside_a_compiled_graph():
    """Under torch.compile (the compiled model on CUDA) the BlockMask is built in-graph; CPU inductor, forward."""
    W, T, bs = 16, 83, 16
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    idx = torch.arange(T)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(idx, idx, W))
    fn = torch.compile(lambda q, k, v: swa_flex(q, k, v, W, block_size=bs), fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = fn(q, k, v)
    assert (out - ref).abs().max() < 1e-5


def test_first_compiled_call_says_so_and_the_cache_dir_persists(monkeypatch, caplog, tmp_path):
    """``compile_model`` points torch's compile caches at a lasting folder (unless the user chose one) and the
    first compiled call of the process logs where it is; later calls log nothing."""
    from elastic_ssm.models.compile import compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr("pathlib.Path.home", lambda: tmp_path)
    model, ids = _tiny(T=12)
    es.compile_model(model, backend="aot_eager")
    assert compile_cache_dir() == tmp_path / ".cache" / "elastic_ssm" / "inductor"
    import os
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache_dir())
    with caplog.at_level("WARNING", logger="elastic_ssm"), torch.no_grad():
        model(ids)
        model(ids)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling the model")]
    assert len(said) == 1 and str(compile_cache_dir()) in said[0]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    es.compile_model(model, backend="aot_eager")
    assert compile_cache_dir() == tmp_path / "mine"                 # the user's choice is kept
