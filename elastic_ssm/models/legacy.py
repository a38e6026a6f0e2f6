"""State dicts written before the projections became ``nn.Linear`` modules (issue #13): detect, convert.

Until then the linear maps were raw parameters in the layouts that made every tier a dim-0 prefix; now
each is the ``weight`` [out, in] of an ``nn.Linear`` (``elastic/slicing.py`` cuts its rows or columns).
The values are the same, so a saved file converts exactly (a reshape, and a transpose where the old
parameter was stored input by output):

| old name (shape) | new name (shape) |
|---|---|
| ESSH ``mixer.in_proj`` [K, P + 3M, D] | ``mixer.in_proj.weight`` [K (P + 3M), D] |
| ESSH ``mixer.out_proj`` [K, P, D] | ``mixer.out_proj.weight`` [D, K P] (transposed) |
| ESSH ``mixer.qkv`` [3D, D], ``mixer.out`` [D, D] (attention) | ``.weight``, unchanged |
| ESSH ``ffn.w_in`` [F, 2, D] | ``ffn.w_in.weight`` [2F, D] |
| ESSH ``ffn.w_out`` [F, D] | ``ffn.w_out.weight`` [D, F] (transposed) |
| ES-SSM ``mixer.proj`` [K, d, d] (M_k transposed) | ``mixer.proj.weight`` [d, K d] (transposed) |

``from_pretrained`` converts old ``model.safetensors`` files on load (the whole file is read, then the
tier's prefixes are cut). A plain ``load_state_dict`` of an old state dict raises instead
(``refuse_legacy``): it is how a training checkpoint resumes, and the optimizer moments saved beside the
weights follow the old parameter order and shapes, so resuming one would fail later with an unrelated
shape error. Convert a state dict explicitly with ``upgrade_state_dict``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["LEGACY_TENSORS", "legacy_names", "upgrade_state_dict", "refuse_legacy"]

#: per architecture: (pattern of an old parameter name, "rows" = flatten to [out, in] | "cols" = flatten
#: to [in, out] and transpose)
LEGACY_TENSORS: dict[str, list[tuple[str, str]]] = {
    "essh": [(r"blocks\.\d+\.mixer\.(in_proj|qkv|out)", "rows"), (r"blocks\.\d+\.mixer\.out_proj", "cols"),
             (r"blocks\.\d+\.ffn\.w_in", "rows"), (r"blocks\.\d+\.ffn\.w_out", "cols")],
    "es_ssm": [(r"blocks\.\d+\.mixer\.proj", "cols")],
}


def _kind(name: str, arch: str) -> str | None:
    return next((kind for pattern, kind in LEGACY_TENSORS.get(arch, []) if re.fullmatch(pattern, name)), None)


def legacy_names(names: Iterable[str], arch: str) -> list[str]:
    """The names among ``names`` that only a state dict of the layout before ``nn.Linear`` holds."""
    return [n for n in names if _kind(n, arch) is not None]


def upgrade_state_dict(state: Mapping[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """``state`` with every old projection renamed to ``<name>.weight`` and laid out [out, in] (contiguous);
    other tensors (and a state dict already in the new layout) pass through unchanged. ``arch``: "essh" or
    "es_ssm" (a model class's ``arch``)."""
    if arch not in LEGACY_TENSORS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(LEGACY_TENSORS)}")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        kind = _kind(name, arch)
        if kind is None:
            out[name] = t
            continue
        w = t.reshape(-1, t.shape[-1])                       # rows: [out, in]; cols: [in, out]
        out[f"{name}.weight"] = w.contiguous() if kind == "rows" else w.t().contiguous()
    return out


def refuse_legacy(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str, *_: object) -> None:
    """``load_state_dict`` pre-hook of the elastic models: one clear error for a state dict of the old layout."""
    old = legacy_names((k[len(prefix):] for k in state_dict if k.startswith(prefix)), module.arch)
    if old:
        raise ValueError(
            f"the state dict holds {prefix}{old[0]} (and {len(old) - 1} more) in the layout before the projections "
            f"became nn.Linear: convert it with elastic_ssm.models.legacy.upgrade_state_dict(state, "
            f"{module.arch!r}) (from_pretrained converts saved directories itself); a training checkpoint written "
            "before that change cannot be resumed (its optimizer state has the old order and shapes); its model/ "
            "directory loads with from_pretrained")
