"""The paper's baselines trained through train() and the CLI (ESSH E.6-E.7, Tables 8, 9, 39, 43, 54)."""

import json

import pytest
import torch
import yaml

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.config import model_config_from_dict
from elastic_ssm.elastic.tiers import parameter_report
from elastic_ssm.models import build_model, check_export, load_pretrained
from elastic_ssm.train import TrainConfig, resolve_recipe_name, train
from elastic_ssm.train.recipes import NestedFFN
from elastic_ssm.train.recover import calibrate, elastify, truncate_and_recover

RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: 30, micro_batch_size: 4, seq_len: 32, optim: {lr: 3.0e-3},
        eval: {every: 0, batches: 1}, checkpoint: {every: 0}, log_every: 1, mixing: {n_warm_tokens: 0}}
data: {source: stdlib, tokenizer: bytes, max_train_bytes: 60000}
"""
BASELINES = {  # CLI model flags -> (arch saved, the recipe 'auto' resolves to)
    "transformer": (["--model.arch", "transformer", "--model.preset", "tiny"], "transformer", "dense"),
    "matformer": (["--model.arch", "matformer", "--model.preset", "tiny"], "matformer", "nested_ffn"),
    "mixer-only": (["--model.preset", "tiny-mixer"], "essh", "capacity_mixed"),
    "specialist": (["--model.tier_config", "T4"], "essh", "dense"),
}


@pytest.mark.parametrize("name", list(BASELINES))
def test_each_baseline_trains_from_the_cli_and_its_loss_falls(name, tmp_path):
    flags, arch, recipe = BASELINES[name]
    (tmp_path / "run.yaml").write_text(RUN)
    out = tmp_path / "out"
    # the others reset the file's recipe; two slots per step so capacity mixing samples reduced capacities
    auto = ["--train.recipe", "auto", "--train.grad_accum", "2"] if name == "mixer-only" else []
    assert main(["train", "--config", str(tmp_path / "run.yaml"), *auto, *flags, "--train.out_dir", str(out)]) == 0
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["arch"] == arch
    recs = [json.loads(x) for x in open(out / "metrics.jsonl")]
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in recs if r["kind"] == "train"][:3] == [1, 2, 3] and len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3          # the loss falls over 30 steps
    params = json.loads((out / "parameters.json").read_text())
    model = load_pretrained(out / "final")
    assert params["params"] == sum(p.numel() for p in model.parameters())
    if name == "specialist":   # Table 43: exactly the tier's shape; its count equals the tier's
        assert params["params"] == es.tier_table(es.ESSHConfig.preset("tiny"))[3].params
        assert params["reference"]["gap"] == 0 and params["reference"]["holds"]
    if name == "matformer":    # one of the four granularities per micro-batch, recorded per step
        caps = {c for r in recs if r["kind"] == "train" for c in r["capacities"]}
        assert caps <= {0.125, 0.25, 0.5, 1.0} and len(caps) >= 3
    assert resolve_recipe_name("auto", model) == recipe


def test_cli_refuses_unknown_arch_and_tier(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(RUN)
    base = ["train", "--config", str(tmp_path / "run.yaml"), "--train.out_dir", str(tmp_path / "o")]
    assert main([*base, "--model.arch", "mamba2"]) == 2
    assert "model.arch must be one of" in capsys.readouterr().err
    assert main([*base, "--model.tier_config", "T11"]) == 2
    assert "model.tier_config: unknown tier 'T11'" in capsys.readouterr().err


@pytest.mark.parametrize("arch,preset,tier", [("essh", "tiny", "T1"), ("essh", "tiny", "T7"),
                                              ("essh", "tiny", "T10"), ("matformer", "tiny", "T4"),
                                              ("es_ssm", "tiny", "K4")])
def test_specialist_parameter_count_equals_the_tier(arch, preset, tier):
    parent = model_config_from_dict({"arch": arch, "preset": preset})
    spec = model_config_from_dict({"arch": arch, "preset": preset, "tier_config": tier})
    model = build_model(spec)
    n = sum(p.numel() for p in model.parameters())
    assert n == es.elastic.tiers.resolve_tier(parent, tier).params == model.num_parameters()
    assert len(model.tier_table()) == 1


def test_matformer_counts_are_table39_and_tiers_export_like_ours():
    big = model_config_from_dict({"arch": "matformer", "preset": "370m"})
    got = [round(t.params / 1e6, 1) for t in es.tier_table(big)]
    assert got == [130.9, 146.0, 168.7, 191.5, 214.2, 248.2, 270.9, 301.2, 331.5, 365.6]   # Table 39
    tf = model_config_from_dict({"arch": "transformer", "preset": "1.5b"})
    assert round(es.elastic.num_parameters(tf) / 1e6, 1) == 1536.3                                   # Table 54
    rep = parameter_report(big, {"arch": "matformer", "preset": "370m"})
    assert rep["reference"]["holds"] and round(100 * rep["reference"]["gap"], 2) == -1.43    # Table 9 vs 370.9M
    model = build_model(model_config_from_dict({"arch": "matformer", "preset": "tiny"}))
    for t in ("T1", "T4", "T10"):
        res = check_export(model, t, seq_len=16)
        assert res.ok and res.bitwise_equal


def test_matformer_projections_are_nn_linear_so_torchao_works_on_an_export():
    import copy

    from torch import nn

    pytest.importorskip("torchao", reason="torchao is in the dev extra")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    torch.manual_seed(0)
    model = build_model(model_config_from_dict({"arch": "matformer", "preset": "tiny"})).eval()
    names = ("qkv", "out", "w_in", "w_out")
    assert {type(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names} == {nn.Linear}
    small = es.export_tier(model, "T4").eval()
    assert small.blocks[0].ffn.w_out.weight.shape == (model.config.d_model, model.resolve_tier("T4").n_ff)
    q = copy.deepcopy(small)
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    assert type(q.blocks[0].qkv.weight) is not torch.Tensor and type(q.blocks[0].ffn.w_in.weight) is not torch.Tensor
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref, out = small(ids), q(ids)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert 0 < rel < 0.05, rel                        # int8 weights: a small, measurable change
        cache = q.allocate_cache(2, 16)
        q(ids[:, :8], cache=cache)
        step = q.step(ids[:, 8], cache)          # activations are quantized per call: close, not equal
        assert ((step - ref[:, 8]).norm() / ref[:, 8].norm()).item() < 0.05


def test_transformer_left_padding_matches_unpadded_rows():
    model = build_model(model_config_from_dict({"arch": "transformer", "preset": "tiny"})).eval()
    ids = torch.randint(0, 256, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], 1).long()
    with torch.no_grad():
        ref, out = model(ids, tier="T1"), model(padded, attention_mask=mask)
    torch.testing.assert_close(out[:, 3:], ref, rtol=1e-5, atol=1e-5)


def test_transformer_decode_of_a_left_padded_batch_equals_each_row_alone():
    """The static KV step after a left-padded prefill: padding slots are never attended and RoPE counts a row's real
    tokens, so every row's logits equal that row decoded alone."""
    torch.manual_seed(0)
    model = build_model(model_config_from_dict({"arch": "transformer", "preset": "tiny"})).to(torch.float64).eval()
    rows = [torch.randint(0, 256, (n,)) for n in (4, 9)]
    ids = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), rows[0]]), rows[1]])
    mask = torch.stack([torch.cat([torch.zeros(5), torch.ones(4)]), torch.ones(9)]).long()
    nxt = torch.randint(0, 256, (6, 2))
    with torch.no_grad():
        cache = model.allocate_cache(2, 16)
        got = [model(ids, attention_mask=mask, cache=cache)[:, -1]] + [model.step(nxt[t], cache) for t in range(6)]
        for r, row in enumerate(rows):
            alone = model.allocate_cache(1, 16)
            want = [model(row[None], cache=alone)[:, -1]] + [model.step(nxt[t, r:r + 1], alone) for t in range(6)]
            for t, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g[r], w[0], rtol=1e-9, atol=1e-9, msg=f"row {r}, step {t}")


def test_nested_ffn_draws_each_granularity_uniformly_for_any_batch_layout():
    cfg = model_config_from_dict({"arch": "matformer", "preset": "tiny"})
    recipe = NestedFFN(cfg, TrainConfig())
    for M in (1, 3):
        labels = [p.label for s in range(400) for p in recipe.global_plan(s, 10**9, M)]
        for g in cfg.granularities:
            assert abs(labels.count(g) / len(labels) - 0.25) < 0.05
    full = [p for p in recipe.global_plan(0, 0, 64) if p.label == 1.0]
    assert full and all(p.tier is None and p.distill is None for p in full)


def _data(seed=0):
    tok = es.data.load_tokenizer("bytes")
    toks = es.data.load_corpus("stdlib", tok, split="train", max_bytes=60_000)
    val = list(es.data.evaluation_batches(es.data.load_corpus("stdlib", tok, split="validation"), 32, 4, 2))
    return toks, val


@pytest.fixture(scope="module")
def dense_parent(tmp_path_factory):
    toks, val = _data()
    cfg = TrainConfig(recipe="dense", steps=40, micro_batch_size=4, seq_len=32, optim={"lr": 3e-3},
                      eval={"every": 0, "batches": 2}, checkpoint={"every": 0}, log_every=100,
                      out_dir=str(tmp_path_factory.mktemp("dense")))
    torch.manual_seed(0)
    res = train(es.ESSHConfig.preset("tiny"), es.data.PackedBatches(toks, 32, 4, seed=0), cfg, progress=False)
    return res.model, toks, val, cfg


@pytest.mark.parametrize("order", ["original", "energy"])
def test_calibration_ranks_units_and_channels_without_changing_the_full_model(dense_parent, order):
    import copy

    parent, toks, val, _ = dense_parent
    model = copy.deepcopy(parent).eval()
    x = val[0][0]
    with torch.no_grad():
        before = model(x)
    calib = list(es.data.evaluation_batches(toks, 32, 4, 3))
    ranking = calibrate(model, calib, channel_order=order)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-4)
    assert ranking["tokens"] == 3 * 4 * 32
    assert any(not torch.equal(p, torch.arange(len(p))) for p in ranking["ffn"])   # units were reordered
    # after ranking, a fresh calibration finds every layer already in decreasing order
    again = calibrate(model, calib, channel_order=order)
    assert all(torch.equal(p, torch.arange(len(p))) for p in again["ffn"] + again["channels"])
    if order == "original":
        assert all(torch.equal(p, torch.arange(len(p))) for p in ranking["channels"])


def test_posthoc_recovery_improves_the_truncated_model(dense_parent, tmp_path):
    parent, toks, val, cfg = dense_parent
    calib = list(es.data.evaluation_batches(toks, 32, 4, 3))
    run = cfg.replace(out_dir=str(tmp_path / "ph"), refine=cfg.refine.replace(steps=20))
    rec = truncate_and_recover(parent, es.data.PackedBatches(toks, 32, 4, seed=1), run, val, protocol="posthoc",
                               tiers=["T2", "T4"], calibration=calib, masks=(1.0, 0.3125, 0.0625), progress=False)
    for a, b in zip(rec.truncated, rec.recovered):
        assert b.loss < a.loss - 0.01, (a, b)
    hist = rec.results[0].history
    assert {h["lr"] for h in hist[1:]} == {1e-4}, hist
    assert all(h["aux"] >= -1e-6 for h in hist), [h["aux"] for h in hist]   # a KL term (>= 0 up to rounding)
    assert "frozen_teacher" not in rec.model.__dict__


@pytest.mark.parametrize("protocol", ["refine", "label_only"])
def test_dense_control_truncated_then_recovered(dense_parent, tmp_path, protocol):
    import copy

    parent, toks, val, cfg = dense_parent
    run = cfg.replace(out_dir=str(tmp_path / protocol), refine=cfg.refine.replace(steps=15, lr=1e-3))
    record = {"recover": {"source": "parent", "protocol": protocol}, "model": parent.config.to_dict(),
              "train": run.to_dict(), "data": {}}
    rec = truncate_and_recover(copy.deepcopy(parent), es.data.PackedBatches(toks, 32, 4, seed=2), run, val,
                               protocol=protocol, tiers=["T1"], progress=False, record=record)
    (row,) = rec.rows()
    assert row["tier"] == "T1" and row["loss_recovered"] < row["loss_truncated"] - 0.01, row
    if protocol == "label_only":   # each tier's run records its own shape and settings
        assert rec.exports["T1"].num_parameters() == parent.num_parameters("T1")
        saved = yaml.safe_load((tmp_path / protocol / "T1" / "run.yaml").read_text())
        assert saved["model"] == rec.exports["T1"].config.to_dict() and saved["train"]["recipe"] == "dense"
    else:
        saved = yaml.safe_load((tmp_path / protocol / "run.yaml").read_text())
        assert saved["model"] == parent.config.to_dict()
    assert saved["recover"] == record["recover"]


def test_elastify_refuses_a_model_without_ffn_layers(tmp_path):
    model = es.ESSSM(es.ESSSMConfig.preset("tiny"))
    with pytest.raises(TypeError, match="ESSH parent"):
        elastify(model, [], TrainConfig(out_dir=str(tmp_path)), [])
