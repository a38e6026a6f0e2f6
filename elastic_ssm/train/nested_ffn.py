"""MatFormer's nested-FFN recipe as the ESSH paper trains its baseline (N.1, Table 9): every slot draws one
granularity uniformly and trains at that FFN width (``n_ff = align floor(d_ff xi / align)``, Table 39) with plain
CE: no distillation, no gradient scaling, no reordering."""

from __future__ import annotations

from typing import Any

from ..elastic.tiers import capacity_tier
from .capacity_mixed import MicroPlan, Recipe, slot_rng

__all__ = ["NestedFFN"]

#: the random stream of this recipe's draws (capacity mixing and refinement use 1 and 2)
_NESTED_STREAM = 3


class NestedFFN(Recipe):
    """One uniformly drawn FFN granularity per micro-batch slot; plain CE at that width (MatFormer, N.1)."""

    name = "nested_ffn"

    def __init__(self, model_cfg: Any, cfg: Any) -> None:
        """The ``granularities`` of the MatFormer config ``model_cfg``, the seed of the ``TrainConfig`` ``cfg``."""
        grains = getattr(model_cfg, "granularities", None)
        if grains is None:
            raise ValueError(f"TrainConfig.recipe='nested_ffn' trains a MatFormer (model.arch matformer); the model "
                             f"config is {type(model_cfg).__name__}")
        self.model_cfg, self.seed = model_cfg, cfg.seed
        self.granularities = tuple(float(x) for x in grains)
        self.tiers = [capacity_tier(model_cfg, x) for x in self.granularities]

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "granularities": list(self.granularities), "seed": self.seed}

    def plan_for(self, index: int) -> MicroPlan:
        xi, tier = self.granularities[index], self.tiers[index]
        if tier.n_ff == self.model_cfg.d_ff:
            return MicroPlan(label=xi)
        return MicroPlan(tier=tier, label=xi)

    def global_plan(self, step: int, tokens_seen: int, n_global: int) -> list[MicroPlan]:
        draws = slot_rng(self.seed, step, _NESTED_STREAM).integers(0, len(self.granularities), size=n_global)
        return [self.plan_for(int(i)) for i in draws]
