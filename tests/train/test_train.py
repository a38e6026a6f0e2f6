"""Training: config, schedule, AdamW groups, capacity-mixed step vs a hand reference (ESSH Alg. 1),
FFN gradient scaling (D.4), importance ordering (D.3), chunked loss (D.6). The runs end to end (recipes,
resume, checkpoints, DDP on gloo, compile, bf16): ``test_train_end_to_end.py``."""

import copy
import dataclasses
import math

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.config import ConfigError
from elastic_ssm.train import (
    CapacityMixed,
    LossModule,
    RefineConfig,
    TrainConfig,
    WarmupCosine,
    loss_sums,
    order_ffn_units,
    param_groups,
    train,
)

L, B = 16, 2


def _tokens(n=6000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def _micro_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 256, (B, L), generator=g)
        labels = torch.randint(0, 256, (B, L), generator=g)
        labels[0, : 3 * i] = -100                  # unequal valid counts N_r
        out.append((ids, labels))
    return out


def _cfg(tmp_path, **kw):
    base = dict(steps=4, micro_batch_size=B, grad_accum=2, seq_len=L, out_dir=str(tmp_path), log_every=1,
                device="cpu", eval=dict(every=0), checkpoint=dict(every=0), mixing=dict(n_warm_tokens=0))
    for k, v in kw.items():   # a section given as a mapping updates the base's section field by field
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return TrainConfig(**base)


def _tiny(cfg, seed=0):
    torch.manual_seed(seed)
    return es.ESSH(cfg)


# ---- config, schedule, groups ---------------------------------------------------------------------
def test_config_defaults_validation_and_yaml(tmp_path):
    cfg = TrainConfig()
    o, mix = cfg.optim, cfg.mixing
    assert (o.lr, o.warmup_frac, o.min_lr_frac, o.betas, o.weight_decay, o.clip) == (
        1.2e-3, 0.01, 0.1, (0.9, 0.95), 0.1, 1.0)
    assert (mix.full_share, mix.kl_coef, mix.alpha_ff, cfg.ordering.every, cfg.ordering.until) == (
        0.75, 0.5, 0.5, 500, 0.8)
    assert mix.capacities == (1 / 16, 3 / 32, 1 / 8, 5 / 32, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
    r = cfg.refine
    assert (r.lr, r.tv_coef, r.warmup_frac, r.min_lr_frac, r.weight_decay) == (6e-5, 5.0, 0.05, 0.0, 0.1)
    assert r.capacities == (2 / 32, 4 / 32, 8 / 32, 16 / 32, 24 / 32) and cfg.budget_dropout.n_full == 8
    assert all(f.metadata.get("help") for f in dataclasses.fields(TrainConfig))
    with pytest.raises(ConfigError, match="full_share"):
        TrainConfig(mixing={"full_share": 1.5})
    with pytest.raises(ConfigError, match="recipe"):
        TrainConfig(recipe="nope")
    with pytest.raises(ConfigError, match="capacity_mode"):
        RefineConfig(capacity_mode="x")
    back = TrainConfig.from_yaml(cfg.replace(refine=RefineConfig(steps=7)).to_yaml())
    assert back.refine.steps == 7 and back == cfg.replace(refine=RefineConfig(steps=7))


def test_lr_schedule_key_steps():
    s = WarmupCosine(peak=1.0, total=100, warmup=10, min_frac=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0) and s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(99) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert all(s(i) >= s(i + 1) for i in range(10, 99)) and min(s(i) for i in range(10, 100)) > 0.1
    assert TrainConfig(steps=1000).warmup_steps == 10
    r = WarmupCosine(peak=6e-5, total=2060, warmup=103, min_frac=0.0)
    assert r(2059) > 0 and r(2059) < 1e-9


def test_param_groups_pretrain_and_refine(tiny_cfg):
    model = _tiny(tiny_cfg)
    g = {"decay" if grp["weight_decay"] else "none": set(grp["names"]) for grp in param_groups(model, 0.1)}
    leaf = lambda names: {n.rsplit(".", 1)[-1] for n in names}
    assert leaf(g["none"]) == {"rho_raw", "theta", "kc", "ks", "beta", "gate_bias", "weight"}
    assert {"embed.weight", "norm_f.weight", "blocks.0.norm1.weight"} <= g["none"]
    owner = lambda names: {n.removesuffix(".weight").rsplit(".", 1)[-1] for n in names}   # nn.Linear: its name
    assert owner(g["decay"]) == {"a", "in_proj", "out_proj", "w_in", "w_out", "qkv", "out"}
    assert g["decay"].isdisjoint(g["none"])
    assert g["decay"] | g["none"] == {n for n, _ in model.named_parameters()}
    r = {"decay" if grp["weight_decay"] else "none": set(grp["names"])
         for grp in param_groups(model, 0.1, "refine")}
    assert {"embed.weight", "blocks.0.mixer.theta", "blocks.0.mixer.gate_bias"} <= r["decay"]
    assert all(dict(model.named_parameters())[n].dim() < 2 for n in r["none"])


# ---- capacity sampling, gradient scaling, losses --------------------------------------------------
def test_capacity_sampling_reserved_slots_and_reproducibility(tiny_cfg, tmp_path):
    rec = CapacityMixed(tiny_cfg, _cfg(tmp_path, mixing=dict(n_warm_tokens=1000)))
    assert rec.capacities_of(3, 999, 8) == [1.0] * 8
    caps = [rec.capacities_of(s, 1000, 8) for s in range(400)]
    assert all(c[:6] == [1.0] * 6 for c in caps) and caps[7] == rec.capacities_of(7, 5000, 8)
    full = sum(x == 1.0 for c in caps for x in c) / (8 * 400)
    assert abs(full - (0.75 + 0.25 / 10)) < 0.02        # D.4: expected full share 0.775


def test_ffn_grad_scale_scales_only_ffn_weight_grads(tiny_cfg):
    model = _tiny(tiny_cfg)
    lm = LossModule(model)
    ids, labels = _micro_batches(1)[0]
    tier = model.resolve_tier(0.25)
    grads = []
    for scale in (None, 0.5):
        model.zero_grad()
        out = lm(ids, labels, tier=tier, ffn_grad_scale=scale, distill=("kl", 0.5))
        out[0].backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])         # forward unchanged
    for n, g in grads[0][1].items():
        if n.endswith(("ffn.w_in.weight", "ffn.w_out.weight")):
            assert torch.equal(grads[1][1][n], 0.5 * g) and g.abs().max() > 0, n
        else:
            assert torch.equal(grads[1][1][n], g), n


def test_ffn_grad_scaled_is_scoped_to_its_block(tiny_cfg):
    """The training knob lives in train/ (not in the model's forward): set on every FFN inside the block,
    restored after it, also when the block raises; the full-capacity teacher pass of a refinement step runs
    outside it, so only the student's FFN gradients are scaled."""
    from elastic_ssm.train.losses import ffn_grad_scaled

    model = _tiny(tiny_cfg)
    with ffn_grad_scaled(model, 0.5):
        assert {f.grad_scale for f in model.ffn_layers()} == {0.5}
    assert {f.grad_scale for f in model.ffn_layers()} == {None}
    with pytest.raises(RuntimeError), ffn_grad_scaled(model, 0.25):
        raise RuntimeError
    assert {f.grad_scale for f in model.ffn_layers()} == {None}
    lm, (ids, labels) = LossModule(model), _micro_batches(1)[0]
    tier = model.resolve_tier(0.25)
    grads = []
    for scale in (None, 0.5):   # refinement: CE(full) + CE(T) + TV; the full pass keeps its gradient
        model.zero_grad()
        lm(ids, labels, tier=tier, ffn_grad_scale=scale, distill=("tv", 5.0), full_ce=True)[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("ffn.w_out.weight")})
    n_ff = tier.n_ff
    for n, g in grads[0].items():   # units beyond the tier see only the full pass: unscaled
        assert torch.equal(grads[1][n][:, n_ff:], g[:, n_ff:]) and g[:, n_ff:].abs().max() > 0, n
        assert not torch.allclose(grads[1][n][:, :n_ff], g[:, :n_ff]), n


def test_loss_sums_kl_and_tv_by_hand():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    y = torch.tensor([1, -100, 3, 0, 6])
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    valid = y != -100
    ce = -ls[valid].gather(1, y[valid, None]).sum()
    kl = (lt.exp() * (lt - ls)).sum(-1)[valid].sum()
    tv = 0.5 * (lt.exp() - ls.exp()).abs().sum(-1)[valid].sum()
    torch.testing.assert_close(loss_sums(s, y, t, 0.5, "kl"), torch.stack([ce + 0.5 * kl, ce, kl]))
    torch.testing.assert_close(loss_sums(s, y, t, 5.0, "tv"), torch.stack([ce + 5 * tv, ce, tv]))


@pytest.mark.parametrize("mode", ["ce", "kl", "refine"])
def test_chunked_loss_equals_full_logit_loss(tiny_cfg, mode):
    model = _tiny(tiny_cfg)
    lm = LossModule(model)
    ids, labels = _micro_batches(2)[1]
    t = model.resolve_tier(0.25)
    kw = {"ce": {}, "kl": dict(tier=t, ffn_grad_scale=0.5, distill=("kl", 0.5)),
          "refine": dict(tier=t, ffn_grad_scale=0.5, distill=("tv", 5.0), full_ce=True)}[mode]
    res = []
    for chunk in (0, 5):
        model.zero_grad()
        out = lm(ids, labels, chunk=chunk, **kw)
        out[0].backward()
        res.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=1e-5)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ---- one capacity-mixed step against a hand-computed Algorithm 1 -----------------------------------
def test_capacity_mixed_step_matches_hand_reference(tiny_cfg, tmp_path):
    M = 4
    data = _micro_batches(M)
    plan_of = lambda s: CapacityMixed(
        tiny_cfg, _cfg(tmp_path, seed=s, grad_accum=M, mixing=dict(full_share=0.5))).capacities_of(0, 0, M)
    seed = next(s for s in range(100) if sum(x < 0.5 for x in plan_of(s)) == 2)
    cfg = _cfg(tmp_path, seed=seed, steps=1, grad_accum=M, mixing=dict(full_share=0.5), optim=dict(clip=0.05))
    plan = CapacityMixed(tiny_cfg, cfg).capacities_of(0, 0, M)
    model = _tiny(tiny_cfg)
    ref = copy.deepcopy(model)
    res = train(model, data, cfg, progress=False)

    params = dict(ref.named_parameters())
    n_tok = sum(int((y != -100).sum()) for _, y in data)
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    total = 0.0
    for (ids, y), xi in zip(data, plan):
        valid = y != -100
        logp = ref(ids, tier=xi).float().log_softmax(-1)
        loss = -logp[valid].gather(1, y[valid, None]).mean()
        if xi != 1.0:
            with torch.no_grad():
                tlogp = ref(ids).log_softmax(-1)
            loss = loss + 0.5 * (tlogp.exp() * (tlogp - logp)).sum(-1)[valid].mean()
        w = int(valid.sum()) / n_tok
        gs = torch.autograd.grad(w * loss, list(params.values()))
        for (n, _), g in zip(params.items(), gs):
            grads[n] += 0.5 * g if (xi != 1.0 and n.endswith(("ffn.w_in.weight", "ffn.w_out.weight"))) else g
        total += w * loss.item()
    assert res.history[0]["loss"] == pytest.approx(total, rel=1e-6)
    assert res.history[0]["capacities"] == plan
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    assert res.history[0]["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    coef = min(1.0, 0.05 / (norm.item() + 1e-6))
    state = torch.load(tmp_path / "pretrain" / "step_0000001" / "optimizer.pt", weights_only=True)
    names = [n for grp in param_groups(ref, 0.1) for n in grp["names"]]
    wd = {n: grp["weight_decay"] for grp in param_groups(ref, 0.1) for n in grp["names"]}
    new = dict(res.model.named_parameters())
    for i, n in enumerate(names):
        g = grads[n] * coef
        torch.testing.assert_close(state["state"][i]["exp_avg"] / 0.1, g, rtol=1e-4, atol=1e-9)
        expect = params[n].detach() * (1 - cfg.optim.lr * wd[n]) - cfg.optim.lr * g / (g.abs() + cfg.optim.eps)
        torch.testing.assert_close(new[n].detach(), expect, rtol=1e-5, atol=1e-7)


# ---- FFN importance ordering -------------------------------------------------------------------------
def test_ffn_ordering_preserves_function_and_moves_moments(tiny_cfg):
    model = _tiny(tiny_cfg)
    model.train()
    for f in model.ffn_layers():
        f.track_activations = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = _micro_batches(1)[0]
    loss_sums(model(ids), labels)[0].backward()
    opt.step()
    other = copy.deepcopy(model)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    model.eval()
    before = model(ids)
    old = [(f.w_in.weight.clone(), f.w_out.weight.clone(), f.act_sq.clone(),
            opt.state[f.w_in.weight]["exp_avg"].clone(), opt.state[f.w_out.weight]["exp_avg_sq"].clone(),
            f.importance()) for f in model.ffn_layers()]
    perms = order_ffn_units(model, opt)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    for f, p, (w_in, w_out, act, m_in, v_out, imp) in zip(model.ffn_layers(), perms, old):
        assert not torch.equal(p, torch.arange(len(p)))
        assert torch.all(imp[p][:-1] >= imp[p][1:])
        rows = torch.stack([2 * p, 2 * p + 1], 1).flatten()          # w_in.weight [2F, D]: (gate_h, up_h) pairs
        assert torch.equal(f.w_in.weight, w_in[rows]) and torch.equal(f.w_out.weight, w_out[:, p])
        assert torch.equal(f.act_sq, act[p])
        assert torch.equal(opt.state[f.w_in.weight]["exp_avg"], m_in[rows])
        assert torch.equal(opt.state[f.w_out.weight]["exp_avg_sq"], v_out[:, p])
    # one more step: the permuted model tracks the unpermuted one row for row
    model.train()
    for m, o in ((model, opt), (other, other_opt)):
        o.zero_grad()
        loss_sums(m(ids), labels)[0].backward()
        o.step()
    for f, g, p in zip(model.ffn_layers(), other.ffn_layers(), perms):
        rows = torch.stack([2 * p, 2 * p + 1], 1).flatten()
        torch.testing.assert_close(f.w_in.weight, g.w_in.weight[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f.w_out.weight, g.w_out.weight[:, p], rtol=1e-5, atol=1e-6)
