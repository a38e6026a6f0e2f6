#!/usr/bin/env python3
"""Block-size sweep of the fused decode products (``elastic_ssm.ops.gemv``) at the preset shapes, batch 1.

``python3 scripts/gpu_gemv_sweep.py [--pdl]`` on a CUDA machine. For every weight shape of one decode step of the
370m and 1.5b presets it checks each kernel configuration against the torch path, then times it: a CUDA
graph of ``REPS`` calls, each on a different copy of the weights (more bytes than the L2 holds), replayed
and timed with events; prints microseconds per call and effective weight bandwidth, next to the cuBLAS
product (``F.linear`` of a bf16 vector) it replaces, and the best configuration per shape. ``--pdl`` sweeps
the products as ``FastDecoder`` launches them with programmatic dependent launch (``ops/pdl.py``): row
kernels whose one tile spans D, output products from transposed copies, per (outputs per program, warps).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from elastic_ssm.ops import gemv  # noqa: E402

REPS = 16
ROWS_CFGS = [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4), (2, 1024, 4), (16, 1024, 8)]
COLS_CFGS = [(64, 64, None), (32, 64, None), (64, 128, None), (32, 128, None), (64, 64, "2x"), (16, 64, "2x")]


def timed(fn, reps=REPS) -> float:
    """Microseconds per call of ``fn(i)`` for i in range(reps), captured in one CUDA graph."""
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
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(ts)[len(ts) // 2]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(name: str, kind: str, N: int, D: int) -> None:
    dev = torch.device("cuda")
    ws = [torch.randn(N, D, device=dev).bfloat16() * 0.05 for _ in range(REPS)]
    x, g = torch.randn(1, D, device=dev), torch.rand(D, device=dev) + 0.5
    nbytes = ws[0].numel() * 2
    if kind in ("rows", "swiglu"):
        op = gemv.norm_gemv if kind == "rows" else gemv.norm_swiglu_gemv
        per_unit = 1 if kind == "rows" else 2                       # weight rows per output
        ref = op(x, ws[0], g, backend="torch")
        xb = x.bfloat16()
        base = timed(lambda i: F.linear(xb, ws[i]))
        out = f"{name:>22} {kind} N={N:6d} D={D}: cuBLAS product {base:6.2f} us ({nbytes / base / 1e6:5.2f} TB/s)"
        best = (1e9, None)
        for bn, bk, nw in ROWS_CFGS:
            kw = dict(block_n=max(4, bn // per_unit), block_k=bk, num_warps=nw, backend="triton")
            err = rel(op(x, ws[0], g, **kw), ref)
            if err > 1e-4:
                print(f"  FAIL {name} {kw}: rel err {err:.2e}", flush=True)
                continue
            t = timed(lambda i, kw=kw: op(x, ws[i], g, **kw))
            best = min(best, (t, (kw["block_n"], bk, nw)))
        default = timed(lambda i: op(x, ws[i], g))
        print(f"{out}; best {best[0]:6.2f} us ({nbytes / best[0] / 1e6:5.2f} TB/s) at {best[1]}; "
              f"default {default:6.2f} us", flush=True)
    else:
        a = torch.randn(1, N, device=dev)
        acc0 = torch.randn(1, D, device=dev)
        want = gemv.gemv_accumulate(a, ws[0], acc0.clone(), backend="torch")
        ab, wt = a.bfloat16(), [w.t() for w in ws]
        wtc = [w.contiguous() for w in wt]
        base = timed(lambda i: F.linear(ab, wt[i]))
        out = f"{name:>22} cols N={N:6d} D={D}: cuBLAS {base:6.2f} us ({nbytes / base / 1e6:5.2f} TB/s)"
        best = (1e9, None)
        auto = max(1, -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // -(-D // 64)))
        for bn, bd, sp in COLS_CFGS:
            split = None if sp is None else 2 * max(1, -(-2 * 132 // -(-D // bd)))
            kw = dict(block_n=bn, block_d=bd, split=split, backend="triton")
            err = rel(gemv.gemv_accumulate(a, ws[0], acc0.clone(), **kw), want)
            if err > 1e-4:
                print(f"  FAIL {name} {kw}: rel err {err:.2e}", flush=True)
                continue
            acc = acc0.clone()
            t = timed(lambda i, kw=kw, acc=acc: gemv.gemv_accumulate(a, ws[i], acc, **kw))
            best = min(best, (t, (bn, bd, split or f"auto({auto})")))
        # the same product through the row kernel from the out-by-in weight (FastDecoder out_layout="rows": the
        # nn.Linear weight itself)
        acc = acc0.clone()
        rows = timed(lambda i, acc=acc: gemv.norm_gemv(a, wtc[i], out=acc, residual=True))
        print(f"{out}; best {best[0]:6.2f} us ({nbytes / best[0] / 1e6:5.2f} TB/s) at {best[1]}; "
              f"rows from a transposed copy {rows:6.2f} us ({nbytes / rows / 1e6:5.2f} TB/s)", flush=True)


PDL_CFGS = [(1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8)]   # (outputs per program, warps)


def sweep_pdl(name: str, kind: str, N: int, D: int) -> None:
    """Row products launched with PDL (one tile spans D): each (outputs per program, warps) against the
    default PDL tile and the ordinary launch, in a chain of REPS dependent calls (as in a decode step)."""
    dev = torch.device("cuda")
    ws = [torch.randn(N, D, device=dev).bfloat16() * 0.05 for _ in range(REPS)]
    x, g = torch.randn(1, D, device=dev), torch.rand(D, device=dev) + 0.5
    op = gemv.norm_gemv if kind == "rows" else gemv.norm_swiglu_gemv
    ref = op(x, ws[0], g, backend="torch")
    nbytes = ws[0].numel() * 2
    best = (1e9, None)
    for bn, nw in PDL_CFGS:
        kw = dict(block_n=bn, num_warps=nw, backend="triton", pdl=True)
        err = rel(op(x, ws[0], g, **kw), ref)
        if err > 1e-4:
            print(f"  FAIL {name} {kw}: rel err {err:.2e}", flush=True)
            continue
        best = min(best, (timed(lambda i, kw=kw: op(x, ws[i], g, **kw)), (bn, nw)))
    default = timed(lambda i: op(x, ws[i], g, pdl=True))
    plain = timed(lambda i: op(x, ws[i], g))
    print(f"{name:>22} {kind} N={N:6d} D={D} PDL: default {default:6.2f} us ({nbytes / default / 1e6:5.2f} TB/s); "
          f"best {best[0]:6.2f} us at (outputs, warps) {best[1]}; ordinary launch {plain:6.2f} us", flush=True)


def main() -> None:
    shapes = {
        "370m": [("in_proj", "rows", 1664, 896), ("out_proj", "cols", 896, 896), ("ffn_in", "swiglu", 9216, 896),
                 ("ffn_out", "cols", 4608, 896), ("qkv", "rows", 2688, 896), ("head", "rows", 50304, 896)],
        "1.5b": [("in_proj", "rows", 2816, 2048), ("out_proj", "cols", 2048, 2048),
                 ("ffn_in", "swiglu", 11264, 2048), ("ffn_out", "cols", 5632, 2048), ("qkv", "rows", 6144, 2048),
                 ("head", "rows", 128256, 2048)],
    }
    pdl = "--pdl" in sys.argv
    for preset, rows in shapes.items():
        for name, kind, N, D in rows:
            try:
                if pdl:   # the row products as FastDecoder launches them with PDL; output products as rows
                    sweep_pdl(f"{preset} {name}", "rows" if kind == "cols" else kind, *((D, N) if kind == "cols"
                                                                                        else (N, D)))
                else:
                    sweep(f"{preset} {name}", kind, N, D)
            except Exception as e:  # report and go on
                print(f"{preset} {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
