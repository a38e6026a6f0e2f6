"""ES-SSM layer and model: Eq. 4 vs the spec, prefix consistency (B.6, B.7), export, save/load, errors."""

import math

import pytest
import torch

from elastic_ssm.config import ESSSMConfig
from elastic_ssm.layers.es_ssm import DropPath, SpectralSublayer
from elastic_ssm.models import check_export, export_tier
from elastic_ssm.models.es_ssm import ESSSM
from elastic_ssm.ops.fft_conv import naive_causal_conv


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path_factory.getbasetemp() / "hankel_cache"))


def tiny(**kw):
    return ESSSMConfig.preset("tiny", **kw)  # d=32, 2 layers, K-bar=8, L=128, budgets (2, 4, 8)


def ids(cfg, B=2, T=50, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def layer64(K=8, d=6, L=40):
    layer = SpectralSublayer(d, K, L, gate_hidden=d // 2).double()
    with torch.no_grad():  # non-trivial gates
        layer.gate_out.bias.normal_()
    return layer


def reference_eq4(layer, u, K):
    """Eq. 4 written out with the direct convolution: sum_k sigmoid(s_k)/sqrt(K) M_k (Phi_k * u)."""
    h = layer.gate_in(u)
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU
    s = h @ layer.gate_out.weight[:K].T + layer.gate_out.bias[:K]  # [B, T, K]
    g = torch.sigmoid(s) / math.sqrt(K)
    x = naive_causal_conv(u, layer.filters[:K])  # [B, T, K, D]
    M = layer.proj.weight.unflatten(1, (layer.n_channels, -1))[:, :K].transpose(0, 1)  # M_k [K, D_out, D_in]
    return torch.einsum("btk,koi,btki->bto", g, M, x)


# ---- layer -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 3, 8])
def test_layer_matches_eq4_float64(K):
    layer = layer64()
    u = torch.randn(2, 33, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(u, K), reference_eq4(layer, u, K), rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.channel_outputs(u, K).sum(2), layer(u, K), rtol=0, atol=1e-12)


def test_layer_init_and_filters():
    layer = SpectralSublayer(32, 8, 128, gate_hidden=16)
    assert torch.all(layer.gate_out.bias == -2.0) and torch.all(layer.gate_in.bias == 0)
    assert layer.filters.dtype == torch.float32 and layer.filters.shape == (8, 128)
    assert torch.all(layer.filters[:, 0] > 0)  # phi_k(0) > 0 sign convention
    assert "filters" in layer.state_dict()  # persistent buffer, not a parameter
    assert "filters" not in dict(layer.named_parameters())


@pytest.mark.parametrize("K", [1, 2, 5])
def test_prefix_consistency_b6(K):
    """Retained z_k(t) do not depend on removed channels (up to the deterministic 1/sqrt(K))."""
    layer = layer64()
    u = torch.randn(2, 40, 6, dtype=torch.float64)
    z_full = layer.channel_outputs(u, 8)[:, :, :K] * math.sqrt(8)
    z_K = layer.channel_outputs(u, K) * math.sqrt(K)
    torch.testing.assert_close(z_K, z_full, rtol=0, atol=1e-12)
    with torch.no_grad():  # scrambling removed channels changes nothing at budget K
        before = layer(u, K)
        layer.proj.weight[:, K * 6:].normal_()   # columns of channels > K
        layer.gate_out.weight[K:].normal_()
        layer.gate_out.bias[K:].normal_()
        layer.filters[K:].normal_()
        assert torch.equal(layer(u, K), before)


def test_removed_channels_get_zero_gradient_b7():
    layer, K = layer64(), 3
    layer(torch.randn(2, 20, 6, dtype=torch.float64), K).square().sum().backward()
    proj = layer.proj.weight.grad.unflatten(1, (8, 6)).transpose(0, 1)   # [K, D_out, D_in], channel first
    for g in (proj, layer.gate_out.weight.grad, layer.gate_out.bias.grad):
        assert torch.all(g[K:] == 0) and torch.all(g[:K].abs().sum(tuple(range(1, g.dim()))) > 0)


def test_drop_path_is_per_sample():
    dp = DropPath(0.5).train()
    y = dp(torch.ones(256, 3, 4))
    per_sample = y.flatten(1)
    assert set(per_sample.unique().tolist()) <= {0.0, 2.0}
    assert torch.all(per_sample.min(1).values == per_sample.max(1).values)  # whole sample kept or dropped
    assert 0 < (per_sample[:, 0] == 0).sum() < 256
    assert torch.equal(dp.eval()(y), y)


# ---- model: export, counts ------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False), dict(task="classify", num_classes=5)])
def test_export_equals_shared_model_every_budget(kw):
    cfg = tiny(**kw)
    model = ESSSM(cfg).eval()
    x = ids(cfg)
    assert sum(p.numel() for p in model.parameters()) == model.num_parameters()
    for K in cfg.budgets:
        small = export_tier(model, K)
        assert small.config.n_channels == K and small.config.budgets[-1] == K
        assert torch.equal(small(x), model(x, tier=K))
        assert sum(p.numel() for p in small.parameters()) == model.num_parameters(K)
        report = check_export(model, K)
        assert report.ok and report.bitwise_equal, str(report)
    out = model(x)
    assert out.shape == ((2, 50, cfg.vocab_size) if cfg.task == "lm" else (2, 5))


def test_tied_head_has_no_extra_parameter():
    model = ESSSM(tiny())
    assert model.lm_head is None
    assert not any("head" in n for n, _ in model.named_parameters())


def test_tier_config_and_rules():
    cfg = tiny()
    assert ESSSM.tier_config(cfg, 4).budgets == (2, 4)
    assert ESSSM.tier_config(cfg, "K3").budgets == (2, 3)
    assert ESSSM.tier_config(cfg, 1).budgets == (1,)
    rows, cols = ESSSM.slice_rules(cfg, 4)
    names = ESSSM(cfg).state_dict().keys()
    cut = sorted(n for n in names if rows.matches(n))
    assert len(cut) == 3 * cfg.n_layers and all(".mixer." in n for n in cut) and rows.dim == 0
    cut = sorted(n for n in names if cols.matches(n))
    assert cut == [f"blocks.{i}.mixer.proj.weight" for i in range(cfg.n_layers)]
    assert (cols.dim, cols.length) == (1, 4 * cfg.d_model)


def test_model_float64_and_bf16_autocast_run():
    cfg = tiny()
    model = ESSSM(cfg).eval()
    x = ids(cfg)
    ref = model(x, tier=4)
    assert model.double()(x, tier=4).dtype == torch.float64
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x, tier=4)
    assert torch.isfinite(low).all()
    torch.testing.assert_close(low.float(), ref, rtol=0.1, atol=0.1)


def test_lm_is_causal_and_mask_pools_valid_positions():
    cfg = tiny()
    model = ESSSM(cfg).eval()
    x = ids(cfg, T=40)
    y = x.clone()
    y[:, 30:] = (y[:, 30:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(x)[:, :30], model(y)[:, :30], rtol=0, atol=1e-5)
    clf = ESSSM(tiny(task="classify", num_classes=3)).eval()
    mask = torch.ones_like(x)
    mask[0, 25:] = 0
    padded = clf(x, attention_mask=mask)
    torch.testing.assert_close(padded[0], clf(x[:1, :25])[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[1], clf(x[1:])[0], rtol=0, atol=1e-5)


def test_meta_construction_skips_init():
    with torch.device("meta"):
        model = ESSSM(tiny())
    assert model.is_meta()
    assert all(b.device.type == "meta" for b in model.buffers())


# ---- save / load ----------------------------------------------------------------------------------
def test_save_load_round_trip_and_tier_load(tmp_path):
    cfg = tiny()
    model = ESSSM(cfg).eval()
    x = ids(cfg)
    model.save_pretrained(tmp_path / "m")
    loaded = ESSSM.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded(x), model(x))
    for K in cfg.budgets:
        part = ESSSM.from_pretrained(tmp_path / "m", tier=K)
        assert part.config.n_channels == K
        assert torch.equal(part(x), export_tier(model, K)(x))
        assert torch.equal(part(x), model(x, tier=K))


def test_saved_filters_are_used(tmp_path):
    cfg = tiny()
    model = ESSSM(cfg).eval()
    with torch.no_grad():  # pretend another LAPACK resolved the filters differently
        for block in model.blocks:
            block.mixer.filters[5:] *= -1
            block.mixer.filters[3] += 0.01
    x = ids(cfg)
    want = model(x)
    model.save_pretrained(tmp_path / "m")
    loaded = ESSSM.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded.blocks[0].mixer.filters, model.blocks[0].mixer.filters)
    assert torch.equal(loaded(x), want)
    fresh = ESSSM(cfg).eval()  # same weights, freshly computed filters: another function
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("filters")},
                          strict=False)
    assert not torch.allclose(fresh(x), want)
    part = ESSSM.from_pretrained(tmp_path / "m", tier=4)
    assert torch.equal(part(x), model(x, tier=4))


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    cfg = tiny()
    model = ESSSM(cfg)
    x = ids(cfg)
    with pytest.raises(ValueError, match=r"shape \[B, T\].*input_ids\[None\]"):
        model(x[0])
    with pytest.raises(ValueError, match="integer tensor"):
        model(x.float())
    with pytest.raises(TypeError, match="torch.Tensor"):
        model(x.tolist())
    with pytest.raises(ValueError, match=r"T=129 exceeds the filter length L=128.*seq_len >= T"):
        model(ids(cfg, T=129))
    for bad in (0, 9, -1, "K0", "T3"):
        with pytest.raises(ValueError, match="tier"):
            model(x, tier=bad)
    with pytest.raises(ValueError, match=r"outside \[1, 8\]"):
        model.blocks[0].mixer(torch.randn(1, 4, 32), 9)
    y = x.clone()
    y[0, 3] = cfg.vocab_size
    with pytest.raises(ValueError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        model(y)
    y[0, 3] = -1
    with pytest.raises(ValueError, match="token id -1"):
        model(y)
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=torch.ones(2, 3))
