"""The one place where tier prefixes are cut (DESIGN rule 3); the prefix of every elastic tensor: docs/architecture.md,
"Prefix layout". A dim-0 prefix is a contiguous view, a dim-1 prefix a strided view BLAS reads in place (an export
stores it contiguous), so the shared model at a tier and its export give bitwise-equal CPU outputs (ESSH Q.2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .staged_read import read_to_device

__all__ = ["SliceRule", "prefix", "empty_linear", "linear", "linear_weight", "is_plain_linear", "has_float_weight",
           "slice_state_dict", "load_sliced_safetensors"]


@dataclass(frozen=True)
class SliceRule:
    """Keep the first ``length`` entries along ``dim`` (0 or 1) of every tensor whose name fully matches
    ``pattern``."""

    pattern: str
    length: int
    dim: int = 0

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


def prefix(t: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """The first ``n`` entries of ``t`` along ``dim`` (a view). Raises if ``n`` is out of range."""
    size = t.shape[dim]
    if not 1 <= n <= size:
        raise ValueError(f"cannot keep a prefix of {n} along dim {dim} of a tensor of shape {tuple(t.shape)}")
    return t if n == size else t.narrow(dim, 0, n)


def empty_linear(d_in: int, d_out: int) -> nn.Linear:
    """An ``nn.Linear(d_in, d_out, bias=False)`` (weight [d_out, d_in]) on the current default device, built on the
    meta device (no random draw spent) and left to the owning layer's ``reset_parameters``. The weight is a plain
    ``torch.empty`` rather than ``to_empty``: on the meta device (``from_pretrained``) the latter's ``empty_like``
    imports torch's symbolic-shapes machinery, ~0.3 s of a fresh process's load."""
    linear = nn.Linear(d_in, d_out, bias=False, device="meta")
    linear.weight = nn.Parameter(torch.empty(d_out, d_in))
    return linear


def is_plain_linear(module: nn.Module) -> bool:
    """True for an ``nn.Linear`` itself (not a quantized replacement or an adapter wrapper around one)."""
    return type(module) is nn.Linear


def has_float_weight(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight is an ordinary tensor (torchao's weight-only quantization keeps the module
    and swaps its weight for a tensor subclass, which kernels reading the raw weight cannot use)."""
    return is_plain_linear(module) and type(module.weight.data) is torch.Tensor


def linear_weight(module: nn.Module, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """The first ``rows`` x ``cols`` block (None = all) of an ``nn.Linear``'s weight ``[out, in]``, a view."""
    if not is_plain_linear(module):
        raise ValueError(f"{type(module).__module__}.{type(module).__qualname__} replaced an elastic nn.Linear "
                         "(quantization or an adapter): it "
                         "runs only at the full width of the model; export the tier first (es.export_tier) and "
                         "quantize / adapt the export")
    w = module.weight
    w = w if rows is None else prefix(w, rows, 0)
    return w if cols is None else prefix(w, cols, 1)


def linear(module: nn.Module, x: torch.Tensor, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """``x [..., cols] -> [..., rows]`` through the first ``rows`` outputs and ``cols`` inputs of ``module`` (None =
    all; the bias is cut with the rows), ``x`` cast to the weight's dtype. A module put in an ``nn.Linear``'s place
    (quantized, LoRA) is called as a module, at full width only (``linear_weight`` refuses a prefix of it)."""
    full = (rows is None or rows == module.out_features) and (cols is None or cols == module.in_features)
    if type(module) is nn.Linear:
        w, b = module.weight, module.bias
        if full and (module._forward_hooks or module._forward_pre_hooks):
            return module(x.to(w.dtype))
        if not full:
            w, b = linear_weight(module, rows, cols), None if b is None or rows is None else prefix(b, rows)
        return F.linear(x.to(w.dtype), w, b)
    if not full:
        linear_weight(module, rows, cols)                   # raises: a replaced module runs at full width only
    weight = getattr(module, "weight", None)
    return module(x.to(weight.dtype) if isinstance(weight, torch.Tensor) else x)


def _rule_for(name: str, rules: Iterable[SliceRule]) -> SliceRule | None:
    hits = [r for r in rules if r.matches(name)]
    if len(hits) > 1:
        raise ValueError(f"tensor {name!r} matches several slice rules: {hits}")
    return hits[0] if hits else None


def slice_state_dict(state: Mapping[str, torch.Tensor], rules: Iterable[SliceRule],
                     clone: bool = True) -> dict[str, torch.Tensor]:
    """Apply ``rules`` to a state dict; unmatched tensors are shared tensors kept whole. With ``clone`` every
    tensor is an independent contiguous copy (a dim-1 prefix then drops the full row stride)."""
    rules = list(rules)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        rule = _rule_for(name, rules)
        s = t if rule is None else prefix(t, rule.length, rule.dim)
        out[name] = s.clone(memory_format=torch.contiguous_format) if clone else s
    return out


def load_sliced_safetensors(path: str | Path, rules: Iterable[SliceRule], device: str | torch.device = "cpu",
                            full: Iterable[SliceRule] | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file, materialising only the retained prefix of each elastic tensor.

    ``full`` (the rules of the full tier) gives the saved size along each cut dim: a tensor of another size is a
    ``ValueError``, since its prefix would load as if it fitted (a file that does not belong to its config). A whole
    file onto CUDA is read in large staged reads (``staged_read.py``); the model's shape check names a mismatch."""
    from safetensors import safe_open

    rules, full = list(rules), list(full or ())
    if torch.device(device).type == "cuda" and (not rules or rules == full):     # the whole file: staged reads
        whole = read_to_device(path, device)
        if whole is not None:
            return whole
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        for name in f.keys():
            rule = _rule_for(name, rules)
            if rule is None:
                out[name] = f.get_tensor(name)
                continue
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            size = shape[rule.dim] if rule.dim < len(shape) else 0
            whole = _rule_for(name, full)
            if whole is not None and size != whole.length:
                raise ValueError(f"{path}: tensor {name} has shape {shape}, the config expects {whole.length} "
                                 f"entries along dim {rule.dim}")
            if not 1 <= rule.length <= size:
                raise ValueError(f"{path}: tensor {name} has {size} entries along dim {rule.dim}, cannot keep "
                                 f"{rule.length}")
            out[name] = sl[: rule.length] if rule.dim == 0 else sl[:, : rule.length]
    return out
