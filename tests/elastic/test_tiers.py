"""Tier tables and exact per-tier costs (ESSH Eq. 7, Eq. 25, Tables 4, 5, 6, 53; ES-SSM Sec. 4)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from elastic_ssm import ESSHConfig, ESSSMConfig
from elastic_ssm.elastic import (
    Tier,
    channels_for,
    ffn_width_for,
    flops_per_token,
    format_tier_table,
    num_parameters,
    parameter_breakdown,
    resolve_tier,
    state_bytes,
    tier_table,
)

# Table 6 of the ESSH paper: K_T, n_ff (1.5B), n_ff (370M), params 1.5B (B, 3 d.p.), 370M (M, 1 d.p.).
TABLE6 = [
    (8, 576, 448, 0.474, 92.1),
    (11, 1024, 832, 0.575, 118.9),
    (15, 1664, 1344, 0.716, 154.7),
    (18, 2176, 1792, 0.828, 185.3),
    (20, 2688, 2240, 0.931, 214.5),
    (23, 3392, 2752, 1.076, 248.8),
    (25, 3840, 3136, 1.168, 274.3),
    (28, 4416, 3648, 1.291, 308.6),
    (30, 5056, 4096, 1.416, 337.9),
    (32, 5632, 4608, 1.531, 370.9),
]


@pytest.fixture(scope="module")
def c370() -> ESSHConfig:
    return ESSHConfig.preset("370m")


@pytest.fixture(scope="module")
def c15() -> ESSHConfig:
    return ESSHConfig.preset("1.5b")


def test_table4_exact_counts(c370, c15):
    assert num_parameters(c370) == 370_866_144
    assert num_parameters(c370, "T4") == 185_254_998
    assert num_parameters(c15) == 1_531_089_696
    assert num_parameters(c15, "T4") == 827_570_754


def test_table4_per_block_rows(c370, c15):
    for cfg, row in ((c15, (8_388_608, 34_603_008, 16_777_216, 4_096)),
                     (c370, (1_605_632, 12_386_304, 3_211_264, 1_792))):
        d, m, K = cfg.d_model, cfg.n_modes, cfg.n_channels
        assert (2 * d * K * cfg.value_width, 3 * d * cfg.d_ff, 4 * d * d, 2 * d) == row
        b = parameter_breakdown(cfg)
        per_block = 2 * d * d + 3 * (K * m * d + K * m) + 4 * K * m + K * m + K
        assert b["spectral"] == cfg.n_spectral_layers * per_block
        assert b["total"] == sum(v for k, v in b.items() if k != "total")


def test_table6_reproduced(c370, c15):
    t15, t370 = tier_table(c15), tier_table(c370)
    assert [t.name for t in t15] == [f"T{i}" for i in range(1, 11)]
    for a, b, (K, nff15, nff370, p15, p370) in zip(t15, t370, TABLE6):
        assert a.K == b.K == K
        assert (a.n_ff, b.n_ff) == (nff15, nff370)
        assert round(a.params / 1e9, 3) == p15
        assert round(b.params / 1e6, 1) == p370
        assert a.K * c15.n_modes == K * 8  # "modes K_T m" column


def test_tables_monotone_and_valid():
    cfgs = [ESSHConfig.preset(p) for p in ("tiny", "small", "370m", "1.5b")]
    cfgs += [ESSSMConfig.preset(p) for p in ("tiny", "small", "byte-base")]
    for cfg in cfgs:
        table = tier_table(cfg)
        assert [t.index for t in table] == list(range(1, len(table) + 1))
        assert table[-1] == resolve_tier(cfg, None)
        for a, b in zip(table, table[1:]):
            assert a.K <= b.K and a.n_ff <= b.n_ff and a.params <= b.params and a.xi < b.xi
        for t in table:
            assert 1 <= t.K <= cfg.n_channels
            if isinstance(cfg, ESSHConfig):
                assert t.n_ff >= cfg.ffn_align and t.n_ff % cfg.ffn_align == 0 and t.n_ff <= cfg.d_ff
        assert table[-1].K == cfg.n_channels


def test_eq7_pieces_and_floor_robustness(c370):
    assert channels_for(c370, 2 / 32) == 8 and ffn_width_for(c370, 2 / 32) == 448  # D.1 example
    assert channels_for(c370, 1.0) == 32 and ffn_width_for(c370, 1.0) == 4608
    # (1/32)^0.8 = 1/16 exactly: 2048 / 16 / 64 = 2, while binary floating point gives 1.99999...
    cfg = ESSHConfig.preset("370m", d_ff=2048)
    assert math.floor(2048 * (1 / 32) ** 0.8 / 64) == 1
    assert ffn_width_for(cfg, 1 / 32) == 128 == ffn_width_for(cfg, Fraction(1, 32))
    assert channels_for(c370, 1e-6) == 1 and ffn_width_for(c370, 1e-6) == 64  # the max(1, .) floors
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="xi"):
            channels_for(c370, bad)
    with pytest.raises(TypeError):
        channels_for(ESSSMConfig.preset("tiny"), 0.5)


def test_resolve_tier_essh(c370):
    t4 = resolve_tier(c370, "T4")
    assert resolve_tier(c370, "t4") == t4 == resolve_tier(c370, t4)
    assert isinstance(t4, Tier) and (t4.index, t4.K, t4.n_ff) == (4, 18, 1792)
    assert resolve_tier(c370, None).name == "T10"
    for bad in ("T0", "T11", "K8", 4, 4.0, "full", ""):
        with pytest.raises(ValueError, match="T1"):
            resolve_tier(c370, bad)
    other = resolve_tier(ESSHConfig.preset("1.5b"), "T4")
    with pytest.raises(ValueError, match="does not belong"):
        resolve_tier(c370, other)


@pytest.mark.parametrize("arch", ["essh", "matformer"])
def test_a_standalone_config_keeps_its_source_tier_name(arch):
    """The export of T4 has one tier, its full model, named T4 (not T1 of its own table); only that name
    resolves, and the tier is the source's T4 in every count."""
    from elastic_ssm.config import model_configs

    cfg = model_configs()[arch].preset("tiny")
    t4 = resolve_tier(cfg, "T4")
    small = cfg.standalone_config(t4)
    (only,) = tier_table(small)
    assert small.tier_names == ("T4",) and (only.name, only.index, only.xi) == ("T4", 1, 1.0)
    assert (only.K, only.n_ff, only.params) == (t4.K, t4.n_ff, t4.params)
    assert resolve_tier(small, "t4") == resolve_tier(small, " T4") == resolve_tier(small, None) == only
    for bad in ("T1", "T5", "K4"):
        with pytest.raises(ValueError, match=r"give one of \['T4'\]"):
            resolve_tier(small, bad)
    assert type(cfg).from_dict(small.to_dict()) == small        # the name survives config.json
    assert cfg.standalone_config(cfg.capacity_tier(0.3)).tier_names == ()   # a fraction's export: T1 of its own


def test_tier_names_must_name_every_tier_in_order(c370):
    named = c370.replace(tier_names=tuple(f"T{i}" for i in range(2, 12)))
    assert [t.name for t in tier_table(named)][:2] == ["T2", "T3"] and resolve_tier(named, "T11").xi == 1.0
    with pytest.raises(ValueError, match="unknown tier 'T1'"):
        resolve_tier(named, "T1")
    for bad, says in [(("T1",), "each of the 10"), (tuple(f"T{i}" for i in range(10, 0, -1)), "increasing"),
                      (tuple(f"X{i}" for i in range(1, 11)), "names T<n>"), (("T1",) * 10, "increasing")]:
        with pytest.raises(ValueError, match=says):
            c370.replace(tier_names=bad)


def test_resolve_tier_esssm():
    cfg = ESSSMConfig.preset("small")
    assert [t.name for t in tier_table(cfg)] == [f"K{k}" for k in cfg.budgets]
    k8 = resolve_tier(cfg, 8)
    assert k8 == resolve_tier(cfg, "K8") == resolve_tier(cfg, "k8") == resolve_tier(cfg, k8)
    assert (k8.index, k8.K, k8.xi, k8.n_ff) == (cfg.budgets.index(8) + 1, 8, 8 / 24, 4 * 128)
    k7 = resolve_tier(cfg, 7)  # off-table budgets are allowed
    assert (k7.name, k7.index) == ("K7", 0)
    assert tier_table(cfg)[4].params < k7.params < k8.params  # K6 < K7 < K8
    for bad in (0, 25, "K0", "T4", True, 2.0):
        with pytest.raises(ValueError, match="K2"):
            resolve_tier(cfg, bad)


def test_esssm_counting_rule():
    cfg = ESSSMConfig.preset("tiny")  # d=32, 2 layers, K-bar=8, V=260, d_g=16, ffn 128, tied
    d, dg, N, V, nff = 32, 16, 2, 260, 128
    per_block = 4 * d + (dg * d + dg + 8 * dg + 8) + 8 * d * d + (2 * d * nff + nff + d)
    assert num_parameters(cfg) == V * d + 2 * d + N * per_block
    # each channel adds its gate row + bias and M_k in every block
    assert num_parameters(cfg, 8) - num_parameters(cfg, 7) == N * (dg + 1 + d * d)
    untied = ESSSMConfig.preset("tiny", tie_embeddings=False)
    assert num_parameters(untied) - num_parameters(cfg) == V * d
    clf = ESSSMConfig.preset("tiny", task="classify", num_classes=10)
    assert num_parameters(clf) - num_parameters(cfg) == d * 10 + 10


def test_untied_essh_head(c370):
    untied = ESSHConfig.preset("370m", tie_embeddings=False)
    assert num_parameters(untied) - num_parameters(c370) == 50304 * 896


def test_table53_state_bytes(c15):
    full, t1 = state_bytes(c15), state_bytes(c15, "T1")
    assert round(full["recurrent"] / 1e6, 2) == 3.28 and round(t1["recurrent"] / 1e6, 2) == 0.82
    assert round(full["kv"] / 1e6, 2) == 50.33 == round(t1["kv"] / 1e6, 2)
    assert round(full["total"] / 1e6, 2) == 53.61 and round(t1["total"] / 1e6, 2) == 51.15
    assert round(state_bytes(c15, "T4")["total"] / 1e6, 2) == 52.17
    assert round(state_bytes(c15, "T7")["total"] / 1e6, 2) == 52.89
    d, m, P = 2048, 8, 64
    assert full["recurrent"] == 2 * 25 * 32 * m * P * 4  # 2 (N - |A|) K m P fp32 entries
    assert full["kv"] == 3 * 2 * 2048 * d * 2
    b = state_bytes(c15, "T4", batch=128, state_dtype_bytes=2, kv_dtype_bytes=1)
    assert b["recurrent"] == 128 * 2 * 25 * 18 * m * P * 2 and b["kv"] == 128 * 3 * 2 * 2048 * d
    assert b["total"] == b["recurrent"] + b["kv"]
    es = ESSSMConfig.preset("tiny")
    assert state_bytes(es) == {"recurrent": 2 * 127 * 32 * 4, "kv": 0, "total": 2 * 127 * 32 * 4}
    with pytest.raises(ValueError):
        state_bytes(c15, batch=0)
    # a fractional or NaN batch gave fractional or NaN bytes, context 0 and decode="foo" were taken silently
    bad = [dict(batch=1.5), dict(batch=float("nan")), dict(batch=True), dict(context=0), dict(state_dtype_bytes=0),
           dict(n_modes=-1), dict(decode="foo")]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw))):
            state_bytes(c15, **kw)
    assert state_bytes(c15, batch=np.int64(2)) == state_bytes(c15, batch=2)


def test_flops(c370):
    d, m, P, V = 896, 8, 28, 50304
    for name in ("T1", "T4", "T10"):
        t = resolve_tier(c370, name)
        f = flops_per_token(c370, name, context=1024)
        assert f["projection"] == 19 * 2 * (2 * d * t.K * P + 3 * d * t.K * m)
        assert f["ffn"] == 22 * 2 * 3 * d * t.n_ff
        assert f["attention"] == 3 * 2 * (4 * d * d + 2 * d * 1024)
        assert f["scan"] == 19 * 2 * t.K * (7 * m * P + 3 * P)
        assert f["head"] == 2 * d * V
        assert f["total"] == sum(v for k, v in f.items() if k != "total")
    full, t1 = flops_per_token(c370), flops_per_token(c370, "T1")
    assert full["total"] > t1["total"] and full["attention"] == t1["attention"]
    assert flops_per_token(c370, context=10**6)["attention"] == full["attention"]  # window-capped
    es = ESSSMConfig.preset("tiny")
    a, b = flops_per_token(es, 2, context=128), flops_per_token(es, 8, context=128)
    assert b["total"] > a["total"] and a["attention"] == 0
    assert a["projection"] == 2 * 2 * (2 * 32 * 32 + 32 * 16 + 16 * 2)
    assert a["ffn"] == 2 * 2 * 2 * 32 * 128 and a["head"] == 2 * 32 * 260


def test_format_tier_table(c15):
    text = format_tier_table(tier_table(c15), c15)
    lines = text.splitlines()
    assert len(lines) == 2 + 10 and "T4" in lines[5] and "827,570,754" in lines[5]
    assert "53.61" in lines[-1] and "state MB" in lines[0]
    plain = format_tier_table(tier_table(ESSSMConfig.preset("tiny")))
    assert "K8" in plain and "state MB" not in plain
    with pytest.raises(ValueError):
        format_tier_table([])


def test_the_kept_tier_table_follows_a_changed_field():
    """The table is built once per config and kept with the field values it came from: a config changed in place
    (``d_ff``, ``tier_xi``) gets the table of its new values, and a caller's edit of the list does not stick."""
    cfg = ESSHConfig.preset("tiny")
    first = tier_table(cfg)
    assert tier_table(cfg) == first and tier_table(cfg) is not first
    first.clear()
    assert len(tier_table(cfg)) == len(cfg.tier_xi)
    cfg.d_ff *= 2
    wider = tier_table(cfg)
    assert wider == ESSHConfig.preset("tiny", d_ff=cfg.d_ff).tier_table()
    assert wider[-1].n_ff == cfg.d_ff and wider[-1].params > ESSHConfig.preset("tiny").tier_table()[-1].params
    cfg.tier_xi = cfg.tier_xi[1:]
    assert [t.xi for t in tier_table(cfg)] == list(cfg.tier_xi)
    assert resolve_tier(cfg, "T1").xi == cfg.tier_xi[0]


@pytest.mark.parametrize("xi", [float("nan"), "0.5", 0.0, 1.5])
def test_a_budget_fraction_that_is_not_in_0_1_is_named(xi):
    """NaN was decimal.InvalidOperation in channels_for / ffn_width_for, a str torch-free TypeError ('<' not
    supported); numpy floats keep working."""
    import numpy as np

    from elastic_ssm.elastic import tiers

    cfg = ESSHConfig.preset("tiny")
    for f in (tiers.channels_for, tiers.ffn_width_for, tiers.capacity_tier):
        with pytest.raises(ValueError, match=r"must lie in \(0, 1\], got"):
            f(cfg, xi)
    assert tiers.capacity_tier(cfg, np.float32(0.5)).K == tiers.capacity_tier(cfg, 0.5).K
