"""GPU check of the ESSH scan op: correctness of the fla and torch paths, then timings (one H200 run).

    python scripts/gpu_scan_check.py   # prints as it goes; writes $OUT/gpu_scan_check.json if OUT is set

Correctness: max |error| / max |reference| of z, the final state and every input gradient, for the fla
path (fp32 inputs; bf16 inputs with q, k, v in fp32 (the default) and in bf16) and the torch chunked path
(fp32) against a float64 reference of the same inputs (tokenwise naive scan for T <= 256, the float64
chunked scan beyond), normal and strong (20-50) clocks; decode step vs scan; T = 131072 fla vs torch.
Timings: torch.cuda.Event over warm repetitions (median ms), fla and torch paths at B=8, T=2048, K=32,
M=8, P in {28, 64}, forward (no grad) and forward+backward; T = 131072 forward; the bare chunk_gla call;
the decode step. Assumes fla-core 0.6.0 and torch 2.11.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from elastic_ssm.ops import (  # noqa: E402
    ModalTables,
    chunk_spectral_scan,
    naive_spectral_scan,
    spectral_scan,
    spectral_scan_step,
)
from elastic_ssm.ops.spectral_scan.chunk_fla import fla_spectral_scan, gla_inputs  # noqa: E402

NAMES = ("v", "write", "read", "clock", "rho", "theta", "kc", "ks", "a", "initial_state")
RESULTS: dict = {"correctness": [], "timings": [], "errors": []}


def say(*args) -> None:
    print(*args, flush=True)


def make_inputs(B, T, K, M, P, strong=False, seed=0, dtype=torch.float32, grad=False):
    """Model-like inputs on CUDA: gates 2 sigmoid, clocks softplus (~0.05; 20-50 on every 4th mode)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32)  # noqa: E731
    un = lambda *s: torch.rand(*s, generator=g, device="cuda", dtype=torch.float32)  # noqa: E731
    clock = torch.nn.functional.softplus(rn(B, T, K, M) - 3)
    if strong:
        clock[..., ::4] = 20 + 30 * un(B, T, K, (M + 3) // 4)
    gate = lambda: 2 * torch.sigmoid(rn(B, T, K, M))  # noqa: E731
    x = dict(v=rn(B, T, K, P), write=gate(), read=gate(), clock=clock, rho=0.5 + 0.499 * un(K, M),
             theta=math.pi * (2 * un(K, M) - 1), kc=rn(K, M) / M, ks=rn(K, M) / M,
             a=torch.full((K, M), 0.5, device="cuda"), initial_state=rn(B, K, M, 2, P))
    x = {n: t.to(dtype) if n in NAMES[:4] else t for n, t in x.items()}
    return {n: t.requires_grad_(grad) for n, t in x.items()}


def tables(x) -> ModalTables:
    return ModalTables(*(x[n] for n in NAMES[4:9]))


def call(fn, x, **kw):
    """The public ops take the nine tensors; the package's own paths take ModalTables."""
    mid = [x[n] for n in NAMES[4:9]] if fn in (naive_spectral_scan, spectral_scan) else [tables(x)]
    return fn(*(x[n] for n in NAMES[:4]), *mid, initial_state=x["initial_state"], output_final_state=True, **kw)


def outputs_and_grads(fn, x, upcast=False, **kw):
    leaves = {n: (t.double() if upcast else t).detach().clone().requires_grad_() for n, t in x.items()}
    z, h = call(fn, leaves, **kw)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dz = torch.randn(z.shape, generator=gen, device="cuda", dtype=torch.float64)
    dh = torch.randn(h.shape, generator=gen, device="cuda", dtype=torch.float64)
    grads = torch.autograd.grad((z.double() * dz).sum() + (h.double() * dh).sum(), [leaves[n] for n in NAMES])
    return z.detach(), h.detach(), grads


def rel(x, ref) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


PATHS = (  # label, input dtype, function, keywords
    ("fla fp32", torch.float32, spectral_scan, {"backend": "fla"}),
    ("fla bf16", torch.bfloat16, spectral_scan, {"backend": "fla"}),  # q, k, v computed in fp32
    ("fla bf16/bf16", torch.bfloat16, fla_spectral_scan, {"compute_dtype": None}),  # q, k, v in bf16
    ("torch fp32", torch.float32, spectral_scan, {"backend": "torch"}),
)


def correctness() -> None:
    say("== correctness: max|err| / max|ref| (z, state, worst input gradient) ==")
    t_values = tuple(int(t) for t in os.environ.get("SCAN_CHECK_T", "1,63,64,65,130,2048").split(","))
    wanted = os.environ.get("SCAN_CHECK_PATHS")
    paths = [p for p in PATHS if wanted is None or p[0] in wanted.split(",")]
    for T in t_values:
        for strong in (False, True):
            base = make_inputs(2, T, 4, 8, 28, strong=strong, seed=T)
            ref_fn = naive_spectral_scan if T <= 256 else chunk_spectral_scan
            refs = {}
            for label, dtype, fn, kw in paths:
                x = {n: t.to(dtype) if n in NAMES[:4] else t for n, t in base.items()}
                if dtype not in refs:  # float64 reference of exactly these (rounded) inputs
                    refs[dtype] = outputs_and_grads(ref_fn, x, upcast=True)
                z_ref, h_ref, g_ref = refs[dtype]
                try:
                    z, h, grads = outputs_and_grads(fn, x, **kw)
                    ge = {n: rel(g, r) for n, g, r in zip(NAMES, grads, g_ref)}
                    worst = max(ge, key=ge.get)
                    finite = bool(torch.isfinite(z).all() and all(torch.isfinite(g).all() for g in grads))
                    row = dict(path=label, T=T, strong=strong, z=rel(z, z_ref), state=rel(h, h_ref), grads=ge,
                               finite=finite)
                    say(f"{label:13s} T={T:5d} strong={strong!s:5s} z {row['z']:.2e} "
                        f"state {row['state']:.2e} grad {ge[worst]:.2e} ({worst}) finite={finite}")
                    RESULTS["correctness"].append(row)
                except Exception as exc:  # keep going: report every failure
                    say(f"{label} T={T} strong={strong} FAILED: {exc!r}")
                    where = f"correctness {label} T={T} strong={strong}"
                    RESULTS["errors"].append(dict(where=where, error=traceback.format_exc()))
    x = make_inputs(2, 70, 4, 8, 28, strong=True, seed=7)
    with torch.no_grad():
        z_ref, h_ref = call(chunk_spectral_scan, x)
        state = x["initial_state"].clone()
        zs = [spectral_scan_step(*(x[n][:, t] for n in NAMES[:4]), tables(x), state)[0]
              for t in range(70)]
    row = dict(path="step vs torch scan fp32", z=rel(torch.stack(zs, 1), z_ref), state=rel(state, h_ref))
    say(f"decode step vs chunked scan: z {row['z']:.2e} state {row['state']:.2e}")
    RESULTS["correctness"].append(row)
    x = make_inputs(1, 131072, 4, 8, 28, seed=11)
    with torch.no_grad():
        z_f, h_f = call(spectral_scan, x, backend="fla")
        z_t, h_t = call(chunk_spectral_scan, x)
    row = dict(path="fla vs torch fp32, T=131072", z=rel(z_f, z_t), state=rel(h_f, h_t),
               finite=bool(torch.isfinite(z_f).all() and torch.isfinite(z_t).all()))
    say(f"T=131072 fla vs torch: z {row['z']:.2e} state {row['state']:.2e} finite={row['finite']}")
    RESULTS["correctness"].append(row)


def timed(fn, warm=3, reps=10) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` warm repetitions (CUDA events)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench(label, B, T, K, M, P, backend, dtype=torch.float32, backward=True, reps=10) -> None:
    """Time ``spectral_scan(backend=...)``; backend "fla-bf16" is the fla path with q, k, v in bf16."""
    if backend == "fla-bf16":
        fn, kw = fla_spectral_scan, {"compute_dtype": None}
    else:
        fn, kw = spectral_scan, {"backend": backend}
    try:
        x = make_inputs(B, T, K, M, P, dtype=dtype, grad=backward)

        def fwd():
            with torch.no_grad():
                call(fn, x, **kw)

        def fwd_bwd():
            z, h = call(fn, x, **kw)
            (z.float().square().sum() + h.sum()).backward()

        row = dict(label=label, B=B, T=T, K=K, M=M, P=P, backend=backend, dtype=str(dtype),
                   fwd_ms=timed(fwd, reps=reps))
        if backward:
            row["fwd_bwd_ms"] = timed(fwd_bwd, reps=reps)
        extra = f"  fwd+bwd {row['fwd_bwd_ms']:8.3f} ms" if backward else ""
        say(f"{label:38s} fwd {row['fwd_ms']:8.3f} ms{extra}")
        RESULTS["timings"].append(row)
    except Exception as exc:
        say(f"{label} FAILED: {exc!r}")
        RESULTS["errors"].append(dict(where=f"bench {label}", error=traceback.format_exc()))


QUICK = os.environ.get("SCAN_CHECK_QUICK") == "1"  # skip the native-bf16 and torch timing rows


def timings() -> None:
    say("== timings (median ms over warm repetitions, torch.cuda.Event) ==")
    for P in (28, 64):
        bench(f"fla fp32 B8 T2048 K32 M8 P{P}", 8, 2048, 32, 8, P, "fla")
        bench(f"fla bf16 B8 T2048 K32 M8 P{P}", 8, 2048, 32, 8, P, "fla", dtype=torch.bfloat16)
        if not QUICK:
            bench(f"fla bf16/bf16 B8 T2048 K32 M8 P{P}", 8, 2048, 32, 8, P, "fla-bf16", dtype=torch.bfloat16)
            bench(f"torch fp32 B8 T2048 K32 M8 P{P}", 8, 2048, 32, 8, P, "torch", reps=5)
    bench("fla fp32 B1 T131072 K32 M8 P64", 1, 131072, 32, 8, 64, "fla", backward=False, reps=5)
    bench("torch fp32 B1 T131072 K32 M8 P64", 1, 131072, 32, 8, 64, "torch", backward=False, reps=3)
    try:  # the bare kernel, to see what the mapping costs around it
        from fla.ops.gla import chunk_gla

        x = make_inputs(8, 2048, 32, 8, 28)
        q, k, v, g, h0 = gla_inputs(*(x[n] for n in NAMES[:4]), tables(x), initial_state=x["initial_state"])
        g, h0 = g.float(), h0.float()
        with torch.no_grad():
            ms = timed(lambda: chunk_gla(q, k, v, g, scale=1.0, initial_state=h0, output_final_state=True))
        say(f"{'bare chunk_gla B8 T2048 H32 K16 V28':38s} fwd {ms:8.3f} ms")
        RESULTS["timings"].append(dict(label="bare chunk_gla B8 T2048 H32 K16 V28", fwd_ms=ms))
        for B in (1, 128):
            y = make_inputs(B, 1, 32, 8, 28)
            state = y["initial_state"].clone()
            args = [y[n][:, 0] for n in NAMES[:4]] + [tables(y)]
            ms = timed(lambda a=args, s=state: spectral_scan_step(*a, s), warm=5, reps=50)
            say(f"{f'torch decode step B{B} K32 M8 P28':38s} {ms:8.3f} ms")
            RESULTS["timings"].append(dict(label=f"torch decode step B{B} K32 M8 P28", ms=ms))
    except Exception as exc:
        say(f"bare kernel / step timing FAILED: {exc!r}")
        RESULTS["errors"].append(dict(where="bare kernel / step", error=traceback.format_exc()))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_scan_check.py needs a CUDA device")
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    for mod in ("triton", "fla"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:
            env[mod] = f"unavailable ({exc!r})"
    RESULTS["env"] = env
    say("env:", json.dumps(env))
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch path in true fp32; fla sets its own precision
    for section in (correctness, timings):
        try:
            section()
        except Exception as exc:
            say(f"{section.__name__} FAILED: {exc!r}")
            RESULTS["errors"].append(dict(where=section.__name__, error=traceback.format_exc()))
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "gpu_scan_check.json"
        path.write_text(json.dumps(RESULTS, indent=2))
        say(f"wrote {path}")
    say(f"done: {len(RESULTS['errors'])} errors")


if __name__ == "__main__":
    main()
