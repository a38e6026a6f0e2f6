"""The theta gradient of the fla scan path against the float64 reference, by sequence length (CUDA).

``tests/ops/test_spectral_scan_gpu.py::test_fla_matches_reference[True-2048-dtype0]`` failed at 5.42e-2 against
3e-2 (2026-12-04, docs/benchmarks.md, "GPU tests"): with strong clocks the reference gradient of the fully decayed
modes is ~1e-10, fla's up to 7.8. The GLA mapping (DESIGN.md, the GLA identity) puts absolute phases ``theta t``
into q and k, so ``d theta = sum_t t * d phase_t``: the relative error of fla's dq and dk (TF32 products) is
multiplied by t. This prints, per T, the theta gradient's error (max |error| / max |reference|, the test's
measure), that of the strong-clock modes alone, and the worst other gradient, under the Triton float32 dot
precision of ``TRITON_F32_DEFAULT`` (unset: tf32; set ``tf32x3`` or ``ieee`` before the process starts), then
the fp32 forward + backward time at T = 2048 (median of 10, CUDA events); each with the default segments of the
theta-gradient path (``chunk_fla.GRAD_SEGMENT``) and with one kernel call for the whole sequence.

    python -m benchmarks.scan_theta_precision                              # fla's default (TF32 products)
    TRITON_F32_DEFAULT=tf32x3 python -m benchmarks.scan_theta_precision    # near-fp32 products
    python -m benchmarks.scan_theta_precision --parts time,precision       # the time first (fla tunes each shape)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "ops"))   # the GPU test's inputs and measure, one definition
from test_spectral_scan_gpu import NAMES, make_inputs, outputs_and_grads, rel  # noqa: E402

from elastic_ssm.ops import chunk_spectral_scan, naive_spectral_scan, spectral_scan  # noqa: E402
from elastic_ssm.ops.spectral_scan import chunk_fla  # noqa: E402

SEGMENTS = (chunk_fla.GRAD_SEGMENT, 1 << 30)   # the theta-gradient path's segments, and none (one kernel call)


def theta_errors(g: list, g_ref: list, strong: bool) -> tuple[float, float, float]:
    """(the theta gradient's error by the GPU test's measure, that of the strong-clock modes alone (every 4th mode;
    NaN without strong clocks), the worst other gradient's error) of ``g`` against the reference ``g_ref``."""
    theta = NAMES.index("theta")
    scale = g_ref[theta].abs().max().item()
    fast = (g[theta].double() - g_ref[theta]).abs()[:, ::4].max().item() / scale if strong else float("nan")
    other = max(rel(a, b) for i, (a, b) in enumerate(zip(g, g_ref)) if i != theta)
    return rel(g[theta], g_ref[theta]), fast, other


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="precision,time",
                    help="comma-separated, run in this order: precision (four shapes), time (T = 2048)")
    known = {"precision": _precision, "time": _time}
    parts = ap.parse_args(argv).parts.split(",")
    if unknown := set(parts) - known.keys():
        ap.error(f"--parts: unknown {sorted(unknown)}; give {' or '.join(known)}, or both")
    if not torch.cuda.is_available():
        print("scan_theta_precision: needs a CUDA device (the fla path)", file=sys.stderr)
        return 2
    print(f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT', '(unset: tf32)')}", flush=True)
    for part in parts:
        known[part]()
    chunk_fla.GRAD_SEGMENT = SEGMENTS[0]
    return 0


def _precision() -> None:
    # four shapes: fla autotunes each new one on first use (tens of seconds each on a fresh machine)
    for strong, T in ((True, 130), (True, 512), (True, 2048), (False, 2048)):
        x = make_inputs(T=T, strong=strong, seed=T)
        ref = naive_spectral_scan if T <= 256 else chunk_spectral_scan
        _, _, g_ref = outputs_and_grads(ref, x, upcast=True)
        for seg in SEGMENTS:                     # the default segments of the theta-gradient path, then one call
            chunk_fla.GRAD_SEGMENT = seg
            _, _, g = outputs_and_grads(spectral_scan, x, backend="fla")
            err, fast, other = theta_errors(g, g_ref, strong)
            print(f"strong={strong} T={T} segment={min(seg, T)}: theta {err:.3e} (strong-clock modes {fast:.3e}); "
                  f"worst other gradient {other:.3e}", flush=True)


def _time() -> None:
    for seg in SEGMENTS:
        chunk_fla.GRAD_SEGMENT = seg
        print(f"fwd+bwd B=8 T=2048 K=32 M=8 P=28 fp32, segment={min(seg, 2048)}: {_fwd_bwd_ms():.3f} ms", flush=True)


def _fwd_bwd_ms() -> float:
    """Median of 10 (after 3 warm-up) forward + backward passes, CUDA events."""
    x = {n: t.detach().requires_grad_() for n, t in make_inputs(B=8, T=2048, K=32, strong=True).items()}
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        z, h = spectral_scan(*(x[n] for n in NAMES[:9]), initial_state=x["initial_state"], output_final_state=True,
                             backend="fla")
        (z.sum() + h.sum()).backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
