"""The one place where tier prefixes are cut (DESIGN rule 3).

Every elastic tensor of both models is laid out so that a tier keeps a *prefix along dim 0*:
ESSH's concatenated mixer input projection is channel-major ``[K, P + 3M, D]``, its output projection
``[K, P, D]``, the modal tables ``[K, M]``, the SwiGLU input ``[F, 2, D]`` and output ``[F, D]``;
ES-SSM's channel projections ``[K, D, D]``, gate rows ``[K, d_g]`` and filters ``[K, L]``. A contiguous
dim-0 prefix is a view with the same base pointer, so the shared model evaluated at a tier and the
standalone export run the same kernels on the same bytes (bitwise-equal outputs on CPU, ESSH Q.2).

``prefix`` is used by layers in the forward pass, ``slice_state_dict`` by ``export_tier`` and
``load_sliced_safetensors`` by ``from_pretrained(..., tier=...)`` (reading only the retained rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SliceRule", "prefix", "slice_state_dict", "sliced_shape", "load_sliced_safetensors"]


@dataclass(frozen=True)
class SliceRule:
    """Keep the first ``length`` entries along dim 0 of every tensor whose name fully matches ``pattern``."""

    pattern: str
    length: int

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


def prefix(t: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """The first ``n`` entries of ``t`` along ``dim`` (a view). Raises if ``n`` is out of range."""
    size = t.shape[dim]
    if not 1 <= n <= size:
        raise ValueError(f"cannot keep a prefix of {n} along dim {dim} of a tensor of shape {tuple(t.shape)}")
    return t if n == size else t.narrow(dim, 0, n)


def _rule_for(name: str, rules: Iterable[SliceRule]) -> SliceRule | None:
    hits = [r for r in rules if r.matches(name)]
    if len(hits) > 1:
        raise ValueError(f"tensor {name!r} matches several slice rules: {hits}")
    return hits[0] if hits else None


def sliced_shape(name: str, shape: tuple[int, ...], rules: Iterable[SliceRule]) -> tuple[int, ...]:
    rule = _rule_for(name, rules)
    if rule is None:
        return tuple(shape)
    if not 1 <= rule.length <= shape[0]:
        raise ValueError(f"{name}: cannot keep {rule.length} of {shape[0]} rows")
    return (rule.length, *shape[1:])


def slice_state_dict(
    state: Mapping[str, torch.Tensor], rules: Iterable[SliceRule], clone: bool = True
) -> dict[str, torch.Tensor]:
    """Apply ``rules`` to a state dict; unmatched tensors are shared tensors kept whole."""
    rules = list(rules)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        rule = _rule_for(name, rules)
        s = t if rule is None else prefix(t, rule.length)
        out[name] = s.clone() if clone else s
    return out


def load_sliced_safetensors(
    path: str | Path, rules: Iterable[SliceRule], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read a safetensors file, materialising only the retained dim-0 prefix of each elastic tensor."""
    from safetensors import safe_open

    rules = list(rules)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        for name in f.keys():
            rule = _rule_for(name, rules)
            if rule is None:
                out[name] = f.get_tensor(name)
                continue
            sl = f.get_slice(name)
            rows = sl.get_shape()[0]
            if not 1 <= rule.length <= rows:
                raise ValueError(f"{path}: tensor {name} has {rows} rows, cannot keep {rule.length}")
            out[name] = sl[: rule.length]
    return out
