"""Budget dropout sampler (ES-SSM Eq. 5): warm-up, anchors, exact snap distribution, determinism."""

import math

import numpy as np
import pytest

from elastic_ssm.config import ESSSMConfig
from elastic_ssm.train.recipes import BudgetSampler, warmup_steps_from_epochs

PAPER = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def test_warmup_is_full_budget():
    s = BudgetSampler(PAPER, 32, warmup_steps=100, n_full=8, seed=1)
    assert all(s.sample(i) == 32 for i in range(100))
    assert any(s.sample(i) != 32 for i in range(100, 120))


def test_anchors_after_warmup():
    s = BudgetSampler(PAPER, 32, warmup_steps=13, n_full=8, seed=2)
    for step in range(13, 2000):
        if step % 8 == 0:
            assert s.sample(step) == 32 and s.is_full_step(step)
        else:
            assert not s.is_full_step(step)
    off = [s.sample(i) for i in range(13, 2000) if i % 8]
    assert set(off) == set(PAPER)  # every budget is reachable between anchors
    no_anchor = BudgetSampler(PAPER, 32, n_full=0)
    assert not any(no_anchor.is_full_step(i) for i in range(64))


def exact_eq5(budgets, full):
    """P(argmin_k |k - K_min (full/K_min)^xi| = b) for xi ~ U[0,1], by bisection of the snap edges."""
    kmin = budgets[0]
    xi_of = lambda x: min(1.0, max(0.0, math.log(x / kmin) / math.log(full / kmin)))
    probs = []
    for i, b in enumerate(budgets):
        lo = kmin if i == 0 else (budgets[i - 1] + b) / 2
        hi = full if i == len(budgets) - 1 else (b + budgets[i + 1]) / 2
        probs.append(xi_of(hi) - xi_of(lo))
    return np.array(probs)


@pytest.mark.parametrize("budgets,full", [(PAPER, 32), ((2, 4, 8), 8), ((1, 2, 3, 7), 7)])
def test_empirical_distribution_matches_eq5(budgets, full):
    s = BudgetSampler(budgets, full, warmup_steps=0, n_full=0, seed=3)
    exact = exact_eq5(budgets, full)
    assert np.allclose(list(s.snap_probabilities().values()), exact, atol=1e-12)
    assert abs(exact.sum() - 1) < 1e-12
    n = 20000
    counts = np.array([c * n for c in s.distribution(n).values()])
    expected = exact * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = len(budgets) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, counts, expected)


def test_expected_distribution_with_anchors():
    s = BudgetSampler(PAPER, 32, n_full=8, seed=4)
    exp = s.expected_distribution()
    assert abs(sum(exp.values()) - 1) < 1e-12
    assert exp[32] == pytest.approx(1 / 8 + 7 / 8 * s.snap_probabilities()[32])
    emp = s.distribution(16000)
    assert all(abs(emp[k] - exp[k]) < 0.02 for k in PAPER)


def test_pure_function_of_seed_and_step():
    a = BudgetSampler(PAPER, 32, warmup_steps=5, seed=7)
    b = BudgetSampler(PAPER, 32, warmup_steps=5, seed=7)
    seq = [a.sample(i) for i in range(500)]
    assert seq == [b.sample(i) for i in range(500)]
    assert [a.sample(i) for i in range(499, 249, -1)] == seq[250:][::-1]  # order-independent (resume)
    other = BudgetSampler(PAPER, 32, warmup_steps=5, seed=8)
    assert seq != [other.sample(i) for i in range(500)]


def test_state_dict_round_trip():
    a = BudgetSampler(PAPER, 32, warmup_steps=50, n_full=4, seed=11)
    b = BudgetSampler((2,), 2)
    b.load_state_dict(a.state_dict())
    assert [b.sample(i) for i in range(300)] == [a.sample(i) for i in range(300)]
    with pytest.raises(KeyError, match="keys"):
        b.load_state_dict({"budgets": [2]})


def test_snap_ties_and_single_budget():
    s = BudgetSampler((2, 4), 4, n_full=0)
    assert s.snap(3.0) == 2 and s.snap(3.0001) == 4
    one = BudgetSampler((8,), 8)
    assert {one.sample(i) for i in range(50)} == {8}
    assert one.snap_probabilities() == {8: 1.0}


def test_from_config_and_epochs():
    cfg = ESSSMConfig.preset("tiny")
    s = BudgetSampler.from_config(cfg, warmup_steps=warmup_steps_from_epochs(1.5, 10))
    assert s.budgets == (2, 4, 8) and s.full == 8 and s.warmup_steps == 15


def test_bad_arguments():
    with pytest.raises(ValueError, match="budgets"):
        BudgetSampler((), 8)
    with pytest.raises(ValueError, match="full budget"):
        BudgetSampler((2, 16), 8)
    with pytest.raises(ValueError, match=">= 0"):
        BudgetSampler((2, 8), 8, warmup_steps=-1)
    with pytest.raises(ValueError, match="step"):
        BudgetSampler((2, 8), 8).sample(-3)
