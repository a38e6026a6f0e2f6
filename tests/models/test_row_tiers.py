"""One forward whose rows run at different tiers (``tier=[...]``, ``elastic/slicing.py``), CPU, float64: each row
equals the forward of its own tier alone, with left padding and into a cache at the widest tier (the first K_T
channels of its mode states equal its own prefill's), forward and backward; the prefill graph's static-buffer
function takes one tier per row and equals the eager forward. Bad input is one ``ValueError``."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.compile import PrefillGraph
from elastic_ssm.models.essh import randomize_selective

F64 = torch.float64
TIERS = ["T1", "T4", "T10", "T4"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny", tie_embeddings=False)), 0.3, True)
    return m.to(F64).eval()


def _ids(model, B=4, T=21, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


@torch.no_grad()
def test_every_row_equals_its_own_tier_forward(model):
    ids = _ids(model)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :5] = False
    mask[3, :11] = False                                # left padding
    mixed = model(ids, tier=TIERS, attention_mask=mask)
    for b, t in enumerate(TIERS):
        alone = model(ids[b:b + 1, ~mask[b].logical_not()], tier=t)[0]
        torch.testing.assert_close(mixed[b, mask[b]], alone, rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_a_cache_at_the_widest_tier_holds_each_rows_own_states(model):
    ids = _ids(model, T=17)
    cache = model.allocate_cache(len(TIERS), "T10", state_dtype=F64)
    logits = model(ids, tier=TIERS, cache=cache)[:, -1]
    for b, t in enumerate(TIERS):
        own = model.allocate_cache(1, t, state_dtype=F64)
        torch.testing.assert_close(logits[b], model(ids[b:b + 1], tier=t, cache=own)[0, -1], rtol=1e-10, atol=1e-10)
        K = model.resolve_tier(t).K
        for (name, mixed_s), own_s in zip(cache.states.items(), own.states.values()):
            torch.testing.assert_close(mixed_s[b, :K], own_s[0], rtol=1e-10, atol=1e-12, msg=name)


def test_gradients_of_a_row_equal_its_own_tier(model):
    ids = _ids(model, B=1, T=13)
    grads = []
    for tier in (["T1"], "T1"):
        model.zero_grad()
        model(ids, tier=tier).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-9, atol=1e-12, msg=n)


@torch.no_grad()
def test_prefill_graph_takes_one_tier_per_row(model):
    ids = _ids(model, B=3, T=12)
    rows = [model.resolve_tier(t) for t in ("T4", "T1", "T10")]
    cache = model.allocate_cache(4, "T10", state_dtype=F64)       # a batch bucket of 4 for 3 prompts
    graph = PrefillGraph(model, cache, 16, True, graph=False, row_tiers=True)
    got = graph(ids, None, rows)
    for b, t in enumerate(rows):
        want = model(ids[b:b + 1], tier=t)[0, -1]
        torch.testing.assert_close(got[b], want, rtol=1e-10, atol=1e-10)
    plain = PrefillGraph(model, model.allocate_cache(4, "T10", state_dtype=F64), 16, True, graph=False)
    with pytest.raises(ValueError, match="row_tiers=True"):
        plain(ids, None, rows)


@torch.no_grad()
def test_bad_row_tiers_are_one_value_error(model):
    ids = _ids(model, B=2, T=5)
    with pytest.raises(ValueError, match="one tier per row: 3 tiers for 2 rows"):
        model(ids, tier=["T1", "T4", "T10"])
    with pytest.raises(ValueError, match="wider than T4"):
        model(ids, tier=["T1", "T10"], cache=model.allocate_cache(2, "T4"))
    with pytest.raises(ValueError):
        model(ids, tier=["T1", "T99"])
