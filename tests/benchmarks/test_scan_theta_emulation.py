"""benchmarks/scan_theta_emulation.py: with float32 product operands the emulated fla path's theta gradient
matches the float64 reference; with TF32 operands its error grows with T while every other gradient stays small
(the mechanism behind the T = 2048 strong-clock GPU failure, docs/benchmarks.md, "GPU tests")."""

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
emulation = importlib.import_module("benchmarks.scan_theta_emulation")


def _errors(capsys, mantissa, *lengths):
    assert emulation.main(["--mantissa", str(mantissa), *map(str, lengths)]) == 0
    rows = re.findall(r"theta ([0-9.e+-]+) \(strong-clock modes [0-9.e+-]+\); worst other gradient ([0-9.e+-]+)",
                      capsys.readouterr().out)
    return [(float(a), float(b)) for a, b in rows]


def test_theta_error_grows_with_length_under_tf32_only(capsys):
    (fp32,) = _errors(capsys, 23, 512)
    short, long = _errors(capsys, 10, 130, 512)
    assert fp32[0] < 1e-3 and fp32[1] < 1e-4
    assert long[0] > 3 * short[0] and long[0] > 100 * fp32[0]
    assert max(short[1], long[1]) < 5e-3                  # the other gradients do not grow with T
    chunk = sys.modules.get("fla.ops.gla.chunk")        # the stand-in was taken out again
    assert chunk is None or getattr(chunk, "chunk_gla_bwd", None) is not emulation.rounded_bwd
