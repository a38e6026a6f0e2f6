"""Channel importance (ESSH App. L.3, Table 31): knock-out through the real forward, output energy, the
ordering and first-N share statistics, and ``elastic-ssm importance`` end to end."""

import copy
import inspect
import json
import sys

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.eval import evaluate_tiers
from elastic_ssm.eval.importance import channel_importance, first_share, ordering
from elastic_ssm.layers.es_ssm import SpectralSublayer
from elastic_ssm.layers.spectral_mixer import SpectralMixer

PLANTED = 5   # zero-based index of the channel the planted model relies on


def _text_ids() -> torch.Tensor:
    return torch.tensor(list(inspect.getsource(json).encode()), dtype=torch.long)


def _batches(ids: torch.Tensor, seed: int, n: int = 8, T: int = 32):
    starts = torch.randint(0, len(ids) - T - 1, (n,), generator=torch.Generator().manual_seed(seed))
    return [(torch.stack([ids[s:s + T] for s in starts]), torch.stack([ids[s + 1:s + T + 1] for s in starts]))]


def _zeroed_copy(model, k: int):
    """A deep copy with channel k's output columns zeroed in every spectral layer (the knock-out by hand):
    ESSH ``out_proj.weight[:, kP:(k+1)P]``, ES-SSM ``proj.weight[:, kD:(k+1)D]`` (M_k)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for m in other.modules():
            if isinstance(m, SpectralMixer):
                m.out_proj.weight[:, k * m.P:(k + 1) * m.P].zero_()
            elif isinstance(m, SpectralSublayer):
                m.proj.weight[:, k * m.d_model:(k + 1) * m.d_model].zero_()
    return other


def test_ordering_and_first_share_follow_their_definitions():
    assert ordering([5.0, 4.0, 2.0, 1.0]) == pytest.approx(1.0)      # importance falls with k
    assert ordering([1.0, 2.0, 4.0, 5.0]) == pytest.approx(-1.0)
    assert ordering([3.0, 3.0, 3.0]) != ordering([3.0, 3.0, 3.0])    # constant profile: NaN
    assert first_share([3.0, -1.0, 1.0], first=1) == pytest.approx(3.0 / 4.0)   # a negative counts as 0
    assert first_share([1.0] * 12, first=8) == pytest.approx(8 / 12)


@pytest.mark.parametrize("arch", ["essh", "es_ssm"])
def test_knockout_is_the_zeroed_model_and_never_writes_the_weights(arch):
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")) if arch == "essh" else es.ESSSM(es.ESSSMConfig.preset("tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = _batches(_text_ids(), seed=0, n=4, T=24)
    res = channel_importance(model, batches)
    assert res.K == model.resolve_tier(None).K == len(res.channels)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    base = evaluate_tiers(model, batches, [None])[0].loss
    assert res.base_loss == pytest.approx(base, abs=1e-6)
    for k in (0, res.K - 1):
        knocked = evaluate_tiers(_zeroed_copy(model, k), batches, [None])[0].loss
        assert res.channels[k].knockout_loss == pytest.approx(knocked, abs=1e-6)
        assert res.channels[k].loss_increase == pytest.approx(knocked - base, abs=1e-6)   # the record's column
    # a channel whose output rows are zero contributes no energy and its knock-out changes nothing
    silent = channel_importance(_zeroed_copy(model, 1), batches)
    assert silent.channels[1].energy == 0.0 and silent.channels[1].delta_ppl == pytest.approx(0.0, abs=1e-9)
    assert all(c.energy > 0 for i, c in enumerate(silent.channels) if i != 1)


def test_energy_is_the_mean_square_of_each_channels_own_output():
    """The meter's energy of channel k (and ``recover.channel_energy`` / (K D)) equals the mean square of the
    mixer's output with every other channel's ``out_proj.weight`` columns zeroed, averaged over layers."""
    from torch.func import functional_call

    from elastic_ssm.train.recover import channel_energy

    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    batches = _batches(_text_ids(), seed=2, n=2, T=16)
    mixers = [m for m in model.modules() if isinstance(m, SpectralMixer)]
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for m in mixers]
    with torch.no_grad():
        model(batches[0][0])
    for h in hooks:
        h.remove()
    res = channel_importance(model, batches)
    K, P, D = mixers[0].K, mixers[0].P, mixers[0].D
    with torch.no_grad():
        for k in (0, 3, K - 1):
            keep = torch.zeros(K * P)
            keep[k * P:(k + 1) * P] = 1
            alone = [functional_call(m, {"out_proj.weight": m.out_proj.weight * keep}, (u,)).square().mean()
                     for m, u in zip(mixers, inputs)]
            assert res.channels[k].energy == pytest.approx(torch.stack(alone).mean().item(), rel=1e-4)
            posthoc = [channel_energy(m, u)[k].item() / (K * D) for m, u in zip(mixers, inputs)]
            assert posthoc == pytest.approx([a.item() for a in alone], rel=1e-4)


def _planted_model(steps: int = 40):
    """A tiny ESSH trained only through one channel: every other weight stays at its random init."""
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    mask = torch.zeros(model.config.n_channels)
    mask[PLANTED] = 1
    params = []
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, SpectralMixer):
            # channel dims: in_proj.weight rows (P + 3M per channel), out_proj.weight columns (P), gate_bias dim 0
            for p, dim, per in ((m.in_proj.weight, 0, m.P + 3 * m.M), (m.out_proj.weight, 1, m.P),
                                (m.gate_bias, 0, 1)):
                keep = mask.repeat_interleave(per).view(-1, *[1] * (p.dim() - 1 - dim))
                p.requires_grad_(True)
                p.register_hook(lambda g, _keep=keep: g * _keep)
                params.append(p)
    opt = torch.optim.Adam(params, lr=1e-2)
    ids = _text_ids()
    for step in range(steps):
        (x, y), = _batches(ids, seed=100 + step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def test_a_planted_dominant_channel_ranks_first():
    model = _planted_model()
    res = channel_importance(model, _batches(_text_ids(), seed=1))
    by_knockout = sorted(res.channels, key=lambda c: -c.delta_ppl)
    by_energy = sorted(res.channels, key=lambda c: -c.energy)
    assert by_knockout[0].channel == PLANTED + 1 and by_energy[0].channel == PLANTED + 1
    assert by_knockout[0].delta_ppl > 10 * abs(by_knockout[1].delta_ppl)
    assert by_knockout[0].delta_bpb > 0


def test_importance_command_writes_table_csv_json_and_plot(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    model_dir = tmp_path / "m"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(model_dir)
    weights = (model_dir / "model.safetensors").read_bytes()
    corpus = tmp_path / "c.txt"
    corpus.write_text(inspect.getsource(json))
    argv = ["importance", str(model_dir), "--data", str(corpus), "--seq_len", "24", "--batch_size", "2",
            "--n_batches", "1", "--first", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-Spearman(k, imp_k)" in out and "first-3 share" in out
    folder = model_dir / "importance"
    rec = json.loads((folder / "channel_importance.json").read_text())
    assert [c["channel"] for c in rec["channels"]] == list(range(1, 9)) and rec["first"] == 3
    assert rec["share_energy"] == pytest.approx(first_share([c["energy"] for c in rec["channels"]], 3))
    assert len((folder / "channel_importance.csv").read_text().splitlines()) == 1 + 8
    assert (folder / "channel_importance.csv").read_text().startswith("channel,knockout_loss,loss_increase,")
    assert (folder / "channel_importance.png").stat().st_size > 1000
    assert (model_dir / "model.safetensors").read_bytes() == weights
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main(argv) == 2                                       # an earlier run's results: refused, kept
    err = capsys.readouterr().err                                # names each earlier file and --overwrite
    assert all(str(folder / name) in err for name in ("channel_importance.csv", "channel_importance.json",
                                                      "channel_importance.png")) and "pass --overwrite" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert main([*argv, "--first", "4", "--overwrite"]) == 0     # replaced on request
    assert json.loads((folder / "channel_importance.json").read_text())["first"] == 4
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)         # as if matplotlib were not installed
    assert main([*argv, "--tier", "T4", "--out", str(tmp_path / "t4")]) == 0
    out = capsys.readouterr().out
    assert "plot skipped: matplotlib is not installed" in out and "at T4 (K=4" in out
    assert not (tmp_path / "t4" / "channel_importance.png").exists()
