"""Budget dropout: the training-budget schedule of ES-SSM (paper Sec. 4.2, Eq. 5; Algorithm 2, whose text ends
mid-way: DESIGN; docs/es_ssm.md, "Budget dropout"). ``sample(step)`` is a pure function of ``(seed, step)``, so a
resumed run reproduces the schedule with no sampler state to save."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["BudgetSampler", "warmup_steps_from_epochs"]


def warmup_steps_from_epochs(epochs: float, steps_per_epoch: int) -> int:
    """Warm-up length in steps of ``epochs`` epochs of ``steps_per_epoch`` steps each (rounded up)."""
    if epochs < 0 or steps_per_epoch < 1:
        raise ValueError(f"need epochs >= 0 and steps_per_epoch >= 1, got {epochs}, {steps_per_epoch}")
    return math.ceil(epochs * steps_per_epoch)


@dataclass(eq=False)
class BudgetSampler:
    """Log-uniform snapped budget sampler (Eq. 5) over the channel counts ``budgets`` (all <= ``full``, K-bar),
    at ``full`` for ``warmup_steps`` steps and on every later ``step % n_full == 0`` (paper: 8; 0: no anchors)."""

    budgets: Sequence[int]
    full: int
    warmup_steps: int = 0
    n_full: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        bs = sorted({int(b) for b in self.budgets})
        if not bs or bs[0] < 1:
            raise ValueError(f"budgets must be a non-empty set of channel counts >= 1, got {list(self.budgets)}")
        if int(self.full) < bs[-1]:
            raise ValueError(f"full budget {self.full} is smaller than the largest budget {bs[-1]}; pass K-bar")
        if self.warmup_steps < 0 or self.n_full < 0 or self.seed < 0:
            raise ValueError(f"warmup_steps, n_full and seed must be >= 0, got {self.warmup_steps}, {self.n_full}, "
                             f"{self.seed}")
        self.budgets, self.full = tuple(bs), int(self.full)
        self.warmup_steps, self.n_full, self.seed = int(self.warmup_steps), int(self.n_full), int(self.seed)
        self._arr = np.asarray(self.budgets, dtype=np.float64)

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> BudgetSampler:
        """A sampler over ``cfg.budgets`` with ``full = cfg.n_channels`` (an ``ESSSMConfig``)."""
        return cls(cfg.budgets, cfg.n_channels, **kw)

    @property
    def k_min(self) -> int:
        return self.budgets[0]

    def is_full_step(self, step: int) -> bool:
        """True for warm-up steps and post-warm-up anchors (``step % n_full == 0``)."""
        return step < self.warmup_steps or (self.n_full > 0 and step % self.n_full == 0)

    def snap(self, target: float) -> int:
        """Nearest budget to ``target`` (Eq. 5 argmin); a tie goes to the smaller budget."""
        return self.budgets[int(np.argmin(np.abs(self._arr - target)))]

    def sample(self, step: int) -> int:
        """K_train of global step ``step`` (>= 0): K-bar on full steps, else Eq. 5's ``target = K_min (K-bar /
        K_min)^xi`` with ``xi ~ U[0, 1)``, snapped to the nearest budget."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.is_full_step(step):
            return self.full
        xi = np.random.default_rng([self.seed, int(step)]).random()
        return self.snap(self.k_min * (self.full / self.k_min) ** xi)

    __call__ = sample

    def snap_probabilities(self) -> dict[int, float]:
        """Exact P(K_train = k) of an Eq. 5 draw (no warm-up, no anchor): budget b_i wins for targets between the
        midpoints around it, and P(target <= x) = log(x / K_min) / log(K-bar / K_min)."""
        if self.full == self.k_min:
            return {b: float(b == self.full) for b in self.budgets}
        span = math.log(self.full / self.k_min)
        cdf = lambda x: min(1.0, max(0.0, math.log(x / self.k_min) / span))
        edges = [self.k_min] + [(a + b) / 2 for a, b in zip(self.budgets, self.budgets[1:])] + [self.full]
        return {b: cdf(hi) - cdf(lo) for b, lo, hi in zip(self.budgets, edges, edges[1:])}

    def expected_distribution(self) -> dict[int, float]:
        """Long-run post-warm-up P(K_train = k): anchors (1 / n_full) mixed with the Eq. 5 draws."""
        a = 1.0 / self.n_full if self.n_full else 0.0
        out = {b: (1.0 - a) * p for b, p in self.snap_probabilities().items()}
        out[self.full] = out.get(self.full, 0.0) + a
        return out

    def distribution(self, n_steps: int, start: int = 0) -> dict[int, float]:
        """Empirical fraction of each budget over steps ``start .. start + n_steps - 1`` (for reports)."""
        if n_steps < 1:
            raise ValueError(f"n_steps must be >= 1, got {n_steps}")
        counts = Counter(self.sample(s) for s in range(start, start + n_steps))
        return {k: counts[k] / n_steps for k in sorted({*self.budgets, self.full})}

    def state_dict(self) -> dict[str, Any]:
        """The settings (the schedule itself is a pure function of them and the step)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"budgets": list(self.budgets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the settings of ``state_dict()``; unknown or missing keys raise ``KeyError``."""
        keys = [f.name for f in fields(self)]
        if set(state) != set(keys):
            raise KeyError(f"BudgetSampler state needs exactly the keys {sorted(keys)}, got {sorted(state)}")
        self.__dict__.update(vars(BudgetSampler(**state)))   # checked before anything changes
