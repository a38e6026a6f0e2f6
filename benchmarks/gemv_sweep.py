"""Tile sweep of the fused decode products (``elastic_ssm.ops.gemv``) at the preset shapes, batch 1 (suite kind
``gemv_sweep``; CUDA only).

For every weight product of one decode step of the ``presets``, each kernel configuration is timed as a CUDA
graph of ``reps`` calls, each on a different copy of the weights (more bytes than the L2 holds), replayed
(``time_graph_us``), next to the cuBLAS product (``F.linear`` of a bf16 vector) it replaces; a row per
shape gives microseconds, effective weight bandwidth and the best configuration. A configuration whose output
differs from the torch path by more than 1e-4 (relative) is left out of the timing and counted in ``wrong``
(the kernels' correctness is checked by ``tests/models/test_fast_decode_gpu.py``). ``pdl`` sweeps the products
as ``FastDecoder`` launches them with programmatic dependent launch (``elastic_ssm/ops/gemv``): row kernels whose
one tile spans D, output products from transposed copies, per (outputs per program, warps).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["GemvSweepOptions", "run_sweep", "SHAPES"]

#: (product, kind, N, D) of one decode step; kind rows = norm + product, swiglu = fused SwiGLU product,
#: cols = input-by-output product accumulated into the residual
SHAPES = {
    "370m": [("in_proj", "rows", 1664, 896), ("out_proj", "cols", 896, 896), ("ffn_in", "swiglu", 9216, 896),
             ("ffn_out", "cols", 4608, 896), ("qkv", "rows", 2688, 896), ("head", "rows", 50304, 896)],
    "1.5b": [("in_proj", "rows", 2816, 2048), ("out_proj", "cols", 2048, 2048), ("ffn_in", "swiglu", 11264, 2048),
             ("ffn_out", "cols", 5632, 2048), ("qkv", "rows", 6144, 2048), ("head", "rows", 128256, 2048)],
}
ROWS_CFGS = [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4), (2, 1024, 4), (16, 1024, 8)]
COLS_CFGS = [(64, 64, None), (32, 64, None), (64, 128, None), (32, 128, None), (64, 64, "2x"), (16, 64, "2x")]
PDL_CFGS = [(1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8)]   # (outputs per program, warps)


def time_graph_us(fn: Callable[[int], object], reps: int, replays: int = 20) -> float:
    """Microseconds per call of ``fn(i)`` for i in range(reps), captured in one CUDA graph (warmed on a side
    stream first) and replayed ``replays`` times; the median replay / ``reps``. Calls on different inputs
    ``i`` (e.g. weight copies larger than the L2 together) time cold reads."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def rel_err(a: torch.Tensor, b: torch.Tensor, norm: str = "fro") -> float:
    """Relative error of ``a`` against the reference ``b``: ``||a - b|| / ||b||`` (``norm="fro"``) or
    ``max|a - b| / max|b|`` (``norm="max"``), computed in float32."""
    a, b = a.float(), b.float()
    if norm == "max":
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@dataclass(kw_only=True)
class GemvSweepOptions(ConfigBase):
    """Which products are swept and how."""

    presets: tuple[str, ...] = opt(("370m", "1.5b"), f"presets whose decode products are swept: {sorted(SHAPES)}")
    pdl: bool = opt(False, "sweep the PDL launches (row kernels, outputs from transposed copies) instead")
    reps: int = opt(16, "calls per graph, each on its own weight copy")

    def validate(self) -> None:
        bad = set(self.presets) - set(SHAPES)
        if bad or self.reps < 1:
            raise ConfigError(f"GemvSweepOptions: presets from {sorted(SHAPES)} and reps >= 1; got {self.presets}, "
                              f"{self.reps}")


def _tbs(nbytes: int, us: float) -> float:
    return nbytes / us / 1e6


def _best(cands: list[tuple[dict, object]], run, ref, reps: int, check=None) -> tuple[float, object, int]:
    """(best us, its configuration, configurations left out as wrong) over ``cands`` of (kwargs, label):
    ``check(kw)`` (default ``run(0, kw)``) must match ``ref``, then ``run(i, kw)`` is timed."""
    best, wrong = (float("inf"), None), 0
    for kw, label in cands:
        if rel_err((check or (lambda k: run(0, k)))(kw), ref) > 1e-4:
            wrong += 1
            continue
        best = min(best, (time_graph_us(lambda i, kw=kw: run(i, kw), reps), label), key=lambda b: b[0])
    return best[0], best[1], wrong


def _sweep(kind: str, N: int, D: int, reps: int) -> dict:
    from elastic_ssm.ops import gemv

    dev = torch.device("cuda")
    ws = [torch.randn(N, D, device=dev).bfloat16() * 0.05 for _ in range(reps)]
    x, g = torch.randn(1, D, device=dev), torch.rand(D, device=dev) + 0.5
    nbytes = ws[0].numel() * 2
    if kind in ("rows", "swiglu"):
        op = gemv.norm_gemv if kind == "rows" else gemv.norm_swiglu_gemv
        per_unit = 1 if kind == "rows" else 2                       # weight rows per output
        xb = x.bfloat16()
        base = time_graph_us(lambda i: F.linear(xb, ws[i]), reps)
        cands = [(dict(block_n=max(4, bn // per_unit), block_k=bk, num_warps=nw, backend="triton"),
                  (max(4, bn // per_unit), bk, nw)) for bn, bk, nw in ROWS_CFGS]
        best, cfg, wrong = _best(cands, lambda i, kw: op(x, ws[i], g, **kw), op(x, ws[0], g, backend="torch"), reps)
        default = time_graph_us(lambda i: op(x, ws[i], g), reps)
        return {"cublas_us": base, "best_us": best, "best_cfg": str(cfg), "default_us": default,
                "cublas_tb_s": _tbs(nbytes, base), "best_tb_s": _tbs(nbytes, best), "wrong": wrong}
    a, acc0 = torch.randn(1, N, device=dev), torch.randn(1, D, device=dev)
    ab, wt = a.bfloat16(), [w.t() for w in ws]
    wtc = [w.contiguous() for w in wt]
    base = time_graph_us(lambda i: F.linear(ab, wt[i]), reps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cands = []
    for bn, bd, sp in COLS_CFGS:
        split = None if sp is None else 2 * max(1, -(-2 * sms // -(-D // bd)))
        cands.append((dict(block_n=bn, block_d=bd, split=split, backend="triton"), (bn, bd, split or "auto")))
    acc = acc0.clone()                       # the timed calls accumulate into one buffer, as in a decode step
    want = gemv.gemv_accumulate(a, ws[0], acc0.clone(), backend="torch")
    best, cfg, wrong = _best(cands, lambda i, kw: gemv.gemv_accumulate(a, ws[i], acc, **kw), want, reps,
                             check=lambda kw: gemv.gemv_accumulate(a, ws[0], acc0.clone(), **kw))
    rows = time_graph_us(lambda i: gemv.norm_gemv(a, wtc[i], out=acc, residual=True), reps)
    return {"cublas_us": base, "best_us": best, "best_cfg": str(cfg), "rows_transposed_us": rows,
            "cublas_tb_s": _tbs(nbytes, base), "best_tb_s": _tbs(nbytes, best), "wrong": wrong}


def _sweep_pdl(kind: str, N: int, D: int, reps: int) -> dict:
    from elastic_ssm.ops import gemv

    dev = torch.device("cuda")
    ws = [torch.randn(N, D, device=dev).bfloat16() * 0.05 for _ in range(reps)]
    x, g = torch.randn(1, D, device=dev), torch.rand(D, device=dev) + 0.5
    op = gemv.norm_gemv if kind == "rows" else gemv.norm_swiglu_gemv
    cands = [(dict(block_n=bn, num_warps=nw, backend="triton", pdl=True), (bn, nw)) for bn, nw in PDL_CFGS]
    best, cfg, wrong = _best(cands, lambda i, kw: op(x, ws[i], g, **kw), op(x, ws[0], g, backend="torch"), reps)
    default = time_graph_us(lambda i: op(x, ws[i], g, pdl=True), reps)
    plain = time_graph_us(lambda i: op(x, ws[i], g), reps)
    return {"default_us": default, "default_tb_s": _tbs(ws[0].numel() * 2, default), "best_us": best,
            "best_cfg": str(cfg), "plain_us": plain, "wrong": wrong}


def run_sweep(opts: GemvSweepOptions, ctx) -> list[dict]:
    """A row per (preset, product): see the module docstring."""
    if not torch.cuda.is_available():
        raise RuntimeError("the gemv sweep times Triton kernels: it needs a CUDA device")
    rows = []
    for preset in opts.presets:
        for name, kind, N, D in SHAPES[preset]:
            if opts.pdl:   # output products run as row products of their transposed copies
                kind, (N, D) = ("rows" if kind == "cols" else kind), ((D, N) if kind == "cols" else (N, D))
            row = {"preset": preset, "product": name, "kind": kind, "N": N, "D": D, "pdl": opts.pdl}
            try:
                row.update((_sweep_pdl if opts.pdl else _sweep)(kind, N, D, opts.reps))
            except Exception as e:  # report the shape and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            ctx.log(f"  {row}")
            rows.append(row)
            torch.cuda.empty_cache()
    return rows
