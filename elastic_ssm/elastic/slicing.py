"""The one place where tier prefixes are cut (DESIGN rule 3); the prefix of every elastic tensor: docs/architecture.md,
"Prefix layout". A dim-0 prefix is a contiguous view, a dim-1 prefix a strided view BLAS reads in place (an export
stores it contiguous), so the shared model at a tier and its export give bitwise-equal CPU outputs (ESSH Q.2).

A whole safetensors file goes onto CUDA in large staged reads (``read_to_device``; ``safe_open(device="cuda")``
faults in every 4 KB page): docs/performance.md, where ``read_to_device`` is described.

Rows of one batch at different tiers: every row computes at the widest tier, and two per-row factors keep only
its own tier's prefix in effect (issue 39, "every tier in one batch").

Tiers are nested prefixes of the same weights (ESSH Sec. 4.1, D.2): a row at tier T reads out its first K_T
spectral channels and its first n_ff(T) FFN units. At the widest tier (K, n_ff) the readout of a row at T is

    y = K^{-1/2} W^out (s * z),   s = sqrt(K / K_T) on the first K_T P entries of z [K P], 0 after,

which is ``K_T^{-1/2} W^out_{:, :K_T P} z_{:K_T}``, its own tier's readout; the FFN's SiLU(gate) * up [n_ff] is
multiplied by a 0/1 unit mask. Channels and units past a row's prefix are computed and discarded: the cost is the
widest tier's, and the kernels run at one shape for every mix. The decode step uses the same two factors
(``FastDecoder(mixed=True)``); the forward and the prefill graphs use them through ``RowTiers``."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .tiers import Tier

__all__ = ["SliceRule", "prefix", "empty_linear", "linear", "linear_weight", "has_float_weight", "slice_state_dict",
           "load_sliced_safetensors", "read_to_device", "parse_header", "CHUNK_BYTES", "READERS", "RowTiers",
           "write_row_factors"]


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


def has_float_weight(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight is an ordinary tensor (torchao's weight-only quantization keeps the module
    and swaps its weight for a tensor subclass, which kernels reading the raw weight cannot use)."""
    return type(module) is nn.Linear and type(module.weight.data) is torch.Tensor


def linear_weight(module: nn.Module, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """The first ``rows`` x ``cols`` block (None = all) of an ``nn.Linear``'s weight ``[out, in]``, a view; a module
    put in its place (a quantized replacement, an adapter wrapper) is refused."""
    if type(module) is not nn.Linear:
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
    file onto CUDA is read in large staged reads (``read_to_device``); the model's shape check names a mismatch."""
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


CHUNK_BYTES = 16 << 20
READERS = 4             # threads reading the file; 2 x READERS x CHUNK_BYTES = 128 MiB of staging
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20     # safetensors' own limit on the header's length


def parse_header(path: str | Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]] | None:
    """``(data_start, {name: (dtype, shape, begin, end)})`` with offsets relative to the data section, or None unless
    the entries tile the data section exactly with known dtypes, sizes matching shapes and aligned offsets."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    start, entries = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        item = dtype.itemsize
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != math.prod(shape) * item \
                or begin % item or min(shape, default=1) < 0:
            return None
        entries[name] = (dtype, shape, begin, end)
    spans = sorted((b, e) for _, _, b, e in entries.values())
    if any(b != prev_end for (b, _), prev_end in zip(spans, [0] + [e for _, e in spans])) or \
            (spans[-1][1] if spans else 0) != size - start:
        return None
    return start, entries


def _fill(fd: int, view: memoryview, offset: int) -> bool:
    """Read ``len(view)`` bytes of the open file ``fd`` from ``offset`` into ``view``; False if the file ends first.
    ``os.preadv`` writes into the buffer and releases the GIL, so several readers copy out of the page cache at
    once (one thread's copy, ~5 GB/s, was the load's slowest stage)."""
    got, n = 0, len(view)
    while got < n:
        r = os.preadv(fd, [view[got:]], offset + got)
        if not r:
            return False
        got += r
    return True


def read_to_device(path: str | Path, device: torch.device | str, chunk: int = CHUNK_BYTES,
                   readers: int = READERS) -> dict[str, torch.Tensor] | None:
    """Every tensor of the safetensors file ``path`` on ``device`` (views of one buffer), or None when the header
    fails its checks, the file ends early or the platform has no ``os.preadv`` (Windows). ``readers`` threads read
    ``chunk``-byte pieces into ``2 x readers`` staging buffers (pinned on CUDA) while the pieces already read are
    copied to the device; a buffer is refilled only after its copy is done (an event per buffer). The CPU takes the
    same path, which its tests check against safetensors."""
    parsed = parse_header(path)
    if parsed is None or not hasattr(os, "preadv"):
        return None
    start, entries = parsed
    device = torch.device(device)
    cuda = device.type == "cuda"
    total = max((e for *_, e in entries.values()), default=0)
    data = torch.empty(total, dtype=torch.uint8, device=device)
    chunk = max(1, min(chunk, total or 1))
    offsets = list(range(0, total, chunk))
    readers = max(1, min(readers, len(offsets) or 1))
    staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(min(2 * readers, len(offsets)))]
    copied: list[torch.cuda.Event | None] = [None] * len(staging)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        with ThreadPoolExecutor(readers) as pool:
            def read(i: int) -> Future:
                k = i % len(staging)
                if copied[k] is not None:
                    copied[k].synchronize()               # this buffer's previous copy has left it
                n = min(chunk, total - offsets[i])
                return pool.submit(_fill, fd, memoryview(staging[k].numpy())[:n], start + offsets[i])

            pending = {i: read(i) for i in range(len(staging))}
            for i, offset in enumerate(offsets):
                if not pending.pop(i).result():
                    return None                           # the file shrank under us: safetensors reports it
                k, n = i % len(staging), min(chunk, total - offset)
                data[offset:offset + n].copy_(staging[k][:n], non_blocking=cuda)
                if cuda:
                    copied[k] = torch.cuda.Event()
                    copied[k].record()
                if i + len(staging) < len(offsets):
                    pending[i + len(staging)] = read(i + len(staging))
    finally:
        os.close(fd)
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return {name: data[b:e].view(dtype).view(shape) for name, (dtype, shape, b, e) in entries.items()}


def write_row_factors(scale: torch.Tensor, units: torch.Tensor, widest: Tier, tier: Tier, value_width: int,
                      whose: str = "", fix: str = "run the batch at the widest tier of its rows") -> None:
    """Write one row's factors in place: ``scale`` [K P] (sqrt(K / K_T) on the first K_T P entries, 0 after) and
    ``units`` [n_ff] (1 on the first n_ff(T), 0 after), for a row at ``tier`` of a batch at ``widest``; ``whose`` and
    ``fix`` word the error for a tier wider than ``widest``."""
    if tier.K > widest.K or tier.n_ff > widest.n_ff:
        raise ValueError(f"tier {tier.name} (K={tier.K}, n_ff={tier.n_ff}) is wider than {whose}{widest.name} "
                         f"(K={widest.K}, n_ff={widest.n_ff}); {fix}")
    keep = tier.K * value_width
    scale[:keep] = math.sqrt(widest.K / tier.K)
    scale[keep:] = 0.0
    units[:tier.n_ff] = 1.0
    units[tier.n_ff:] = 0.0


@dataclass(eq=False)
class RowTiers:
    """A batch whose rows run at tiers nested in ``widest``, computed at ``widest`` (``K``, ``n_ff`` and ``name`` are
    its, so layers size their work as at ``widest``). ``channel_scale`` [B, K P] and ``unit_mask`` [B, n_ff] are the
    factors of ``write_row_factors`` (float32, or the dtype given)."""

    widest: Tier
    channel_scale: torch.Tensor
    unit_mask: torch.Tensor

    @classmethod
    def build(cls, widest: Tier, tiers: Sequence[Tier], value_width: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> RowTiers:
        out = cls(widest, torch.empty(len(tiers), widest.K * value_width, dtype=dtype, device=device),
                  torch.empty(len(tiers), widest.n_ff, dtype=dtype, device=device))
        out.assign(tiers, value_width)
        return out

    def assign(self, tiers: Sequence[Tier], value_width: int) -> None:
        """Rewrite the factors in place for ``tiers`` (one per row; rows past them repeat the first): a captured
        graph that reads these buffers stays valid."""
        if not 1 <= len(tiers) <= self.batch:
            raise ValueError(f"{len(tiers)} row tiers for a batch of {self.batch}")
        host_s = torch.empty(self.channel_scale.shape, dtype=self.channel_scale.dtype)   # [B, K P]
        host_u = torch.empty(self.unit_mask.shape, dtype=self.unit_mask.dtype)           # [B, n_ff]
        for row, t in enumerate(list(tiers) + [tiers[0]] * (self.batch - len(tiers))):
            write_row_factors(host_s[row], host_u[row], self.widest, t, value_width)
        self.channel_scale.copy_(host_s)
        self.unit_mask.copy_(host_u)

    @property
    def batch(self) -> int:
        return self.channel_scale.shape[0]

    K = property(attrgetter("widest.K"))
    n_ff = property(attrgetter("widest.n_ff"))
    name = property(attrgetter("widest.name"))
