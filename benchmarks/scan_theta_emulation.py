"""CPU emulation of the fla scan path's theta-gradient error: the GLA mapping of ``chunk_fla`` over a tokenwise
float32 GLA whose product operands (and their gradients) are rounded to ``--mantissa`` bits (10: TF32, what
fla's float32 ``tl.dot`` uses on Hopper; 23: float32), in place of fla's kernels (``tests/fla_stand_in.py``'s
seam). Prints, per T, the GPU test's measure of the theta gradient against the float64 reference (strong clocks),
that of the strong-clock modes alone, and the worst other gradient. It rounds harder than fla (its state too,
at every token; fla accumulates in float32 within a chunk), so it bounds the mechanism, not fla's numbers.

    python -m benchmarks.scan_theta_emulation --mantissa 10 130 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops")]
import fla_stand_in  # noqa: E402
import test_spectral_scan_gpu as gpu_test  # noqa: E402
from _pytest.monkeypatch import MonkeyPatch  # noqa: E402

from benchmarks.scan_theta_precision import theta_errors  # noqa: E402
from elastic_ssm.ops import chunk_spectral_scan, naive_spectral_scan  # noqa: E402
from elastic_ssm.ops.spectral_scan.chunk_fla import fla_spectral_scan  # noqa: E402

MANTISSA = [10]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` with ``MANTISSA[0]`` explicit mantissa bits (round to nearest)."""
    if MANTISSA[0] >= 23:
        return x
    m, e = torch.frexp(x)
    s = 2.0 ** (MANTISSA[0] + 1)
    return torch.ldexp(torch.round(m * s) / s, e)


class Rounded(torch.autograd.Function):
    """A product operand as a TF32 kernel sees it: rounded forward, and its gradient rounded backward."""

    @staticmethod
    def forward(x):
        return rounded(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return rounded(g)


def rounded_gla(q, k, v, g, h0, scale=1.0):
    """Tokenwise GLA (``fla_stand_in.naive_gla``) in float32 with rounded product operands."""
    S, outs, r = h0.float(), [], Rounded.apply
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[..., None] * S + r(k[:, t])[..., None] * r(v[:, t])[..., None, :]
        outs.append(torch.einsum("bhd,bhdp->bhp", r(q[:, t] * scale), r(S)))
    return torch.stack(outs, 1), S


def rounded_bwd(q, k, v, g, g_cumsum, scale, initial_state, h, A, do, dht, cu_seqlens=None, chunk_size=64,
                chunk_indices=None):
    """``chunk_gla_bwd``'s contract (the stand-in's) with the gradients of ``rounded_gla``."""
    gate = fla_stand_in._gate_from_cumsum(g_cumsum.double(), chunk_size).float()
    h0 = fla_stand_in._state0(q, v, initial_state).float()
    (_, S), vjp = torch.func.vjp(lambda *a: rounded_gla(*a, scale), q.float(), k.float(), v.float(), gate, h0)
    dq, dk, dv, dg, dh0 = vjp((do.float(), torch.zeros_like(S) if dht is None else dht.float()))
    return dq, dk, dv.to(do.dtype), dg, None if initial_state is None else dh0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mantissa", type=int, default=10, help="explicit mantissa bits of a product operand")
    ap.add_argument("lengths", type=int, nargs="+")
    args = ap.parse_args(argv)
    MANTISSA[0] = args.mantissa
    patch = MonkeyPatch()
    fla_stand_in.install(patch)
    sys.modules["fla.ops.gla.chunk"].chunk_gla_bwd = rounded_bwd
    try:
        for T in args.lengths:
            x = gpu_test.make_inputs(T=T, strong=True, seed=T, device="cpu")
            ref = naive_spectral_scan if T <= 256 else chunk_spectral_scan
            _, _, g_ref = gpu_test.outputs_and_grads(ref, x, upcast=True)
            _, _, g = gpu_test.outputs_and_grads(fla_spectral_scan, x)
            err, fast, other = theta_errors(g, g_ref, strong=True)
            print(f"mantissa {args.mantissa}, T = {T}: theta {err:.3e} (strong-clock modes {fast:.3e}); worst "
                  f"other gradient {other:.3e}", flush=True)
    finally:
        patch.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
