"""Timing of the ESSH spectral scan op per path and shape (suite kind ``scan_timing``; CUDA).

``es.ops.spectral_scan`` on model-like inputs (gates 2 sigmoid, clocks softplus around 0.05, modal tables of a
stable fit): forward without grad and forward + backward (median ms over warm repetitions, CUDA events) at
B x T x K x M x P for each value width P and path: ``fla fp32`` (fp32 inputs), ``fla bf16`` (bf16 inputs, q/k/v
computed in fp32), ``fla bf16/bf16`` (q/k/v in bf16), ``torch fp32`` (the chunked PyTorch scan); then the
long-sequence forward (``long_length``) of fla and torch, the bare ``fla.ops.gla.chunk_gla`` call on the mapped
inputs (what the mapping costs around it), and the torch decode step per batch. The accuracy of these paths
against the float64 reference is checked by ``tests/ops/test_spectral_scan_gpu.py``, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elastic_ssm.bench.decode import summarize, time_fn
from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["ScanTimingOptions", "run_scan_timing", "scan_inputs"]

_NAMES = ("v", "write", "read", "clock", "rho", "theta", "kc", "ks", "a", "initial_state")
_PATHS = ("fla fp32", "fla bf16", "fla bf16/bf16", "torch fp32")


@dataclass(kw_only=True)
class ScanTimingOptions(ConfigBase):
    """Shapes and paths of the scan timing."""

    paths: tuple[str, ...] = opt(_PATHS, f"paths to time: {', '.join(_PATHS)}")
    batch: int = opt(8, "B")
    length: int = opt(2048, "T")
    channels: int = opt(32, "K (GLA heads)")
    modes: int = opt(8, "M modes per channel (key width 2M)")
    widths: tuple[int, ...] = opt((28, 64), "value widths P")
    backward: bool = opt(True, "also time forward + backward")
    long_length: int = opt(131072, "batch-1 forward at this T for fla and torch (0: skip)")
    bare_kernel: bool = opt(True, "time the bare chunk_gla call on the mapped inputs")
    step_batches: tuple[int, ...] = opt((1, 128), "batches of the torch decode step timing (empty: skip)")
    warmup: int = opt(3, "untimed repetitions")
    iters: int = opt(10, "timed repetitions (median)")

    def validate(self) -> None:
        bad = set(self.paths) - set(_PATHS)
        if bad:
            raise ConfigError(f"ScanTimingOptions.paths: unknown {sorted(bad)}; choose from {_PATHS}")
        if min(self.batch, self.length, self.channels, self.modes, self.iters, *self.widths) < 1:
            raise ConfigError("ScanTimingOptions: shapes and iters must be >= 1")


def scan_inputs(B: int, T: int, K: int, M: int, P: int, dtype=torch.float32, grad: bool = False, seed: int = 0,
                device: str = "cuda") -> dict[str, torch.Tensor]:
    """Model-like inputs of ``spectral_scan`` (v/write/read/clock in ``dtype``, tables fp32), by name."""
    g = torch.Generator(device=device).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=device)
    un = lambda *s: torch.rand(*s, generator=g, device=device)
    x = dict(v=rn(B, T, K, P), write=2 * torch.sigmoid(rn(B, T, K, M)), read=2 * torch.sigmoid(rn(B, T, K, M)),
             clock=torch.nn.functional.softplus(rn(B, T, K, M) - 3), rho=0.5 + 0.499 * un(K, M),
             theta=math.pi * (2 * un(K, M) - 1), kc=rn(K, M) / M, ks=rn(K, M) / M,
             a=torch.full((K, M), 0.5, device=device), initial_state=rn(B, K, M, 2, P))
    return {n: (t.to(dtype) if n in _NAMES[:4] else t).requires_grad_(grad) for n, t in x.items()}


def _call(fn, x, **kw):
    return fn(*(x[n] for n in _NAMES[:9]), initial_state=x["initial_state"], output_final_state=True, **kw)


def _fn(path: str):
    from elastic_ssm.ops import ModalTables, spectral_scan
    from elastic_ssm.ops.spectral_scan.chunk_fla import fla_spectral_scan

    if path == "fla bf16/bf16":
        return (lambda v, w, r, c, *tables, **kw: fla_spectral_scan(v, w, r, c, ModalTables(*tables), **kw),
                {"compute_dtype": None})
    return spectral_scan, {"backend": path.split()[0]}


def run_scan_timing(opts: ScanTimingOptions, ctx) -> list[dict]:
    """Rows ``{"label", "path", "B", "T", "K", "M", "P", "fwd_ms", "fwd_bwd_ms"}`` and ``{"label", "ms"}``."""
    from elastic_ssm.ops import ModalTables, spectral_scan_step

    if not torch.cuda.is_available():
        raise RuntimeError("the scan timing runs the fla and CUDA paths: it needs a CUDA device")
    dev, rows = torch.device("cuda"), []
    med = lambda f, iters=opts.iters: summarize(time_fn(f, opts.warmup, iters, dev))["ms"]

    def timed(label: str, path: str, B: int, T: int, P: int, backward: bool, iters: int) -> None:
        row: dict = {"label": label, "path": path, "B": B, "T": T, "K": opts.channels, "M": opts.modes, "P": P}
        try:
            fn, kw = _fn(path)
            dtype = torch.bfloat16 if "bf16" in path else torch.float32
            x = scan_inputs(B, T, opts.channels, opts.modes, P, dtype, grad=backward)
            with torch.no_grad():
                row["fwd_ms"] = med(lambda: _call(fn, x, **kw), iters)
            if backward:
                def fwd_bwd():
                    z, h = _call(fn, x, **kw)
                    (z.float().square().sum() + h.sum()).backward()
                row["fwd_bwd_ms"] = med(fwd_bwd, iters)
        except Exception as e:  # report and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        ctx.log(f"  {row}")
        rows.append(row)

    for P in opts.widths:
        for path in opts.paths:
            iters = opts.iters if path != "torch fp32" else max(1, opts.iters // 2)
            timed(f"{path} B{opts.batch} T{opts.length} P{P}", path, opts.batch, opts.length, P, opts.backward, iters)
    if opts.long_length:
        for path in ("fla fp32", "torch fp32"):
            timed(f"{path} B1 T{opts.long_length} P{opts.widths[-1]}", path, 1, opts.long_length, opts.widths[-1],
                  False, 3)
    if opts.bare_kernel:
        try:
            from fla.ops.gla import chunk_gla

            from elastic_ssm.ops.spectral_scan.chunk_fla import gla_inputs

            x = scan_inputs(opts.batch, opts.length, opts.channels, opts.modes, opts.widths[0])
            from elastic_ssm.ops import ModalTables

            q, k, v, g, h0 = gla_inputs(*(x[n] for n in _NAMES[:4]), ModalTables(*(x[n] for n in _NAMES[4:9])),
                                        initial_state=x["initial_state"])
            g, h0 = g.float(), h0.float()
            with torch.no_grad():
                ms = med(lambda: chunk_gla(q, k, v, g, scale=1.0, initial_state=h0, output_final_state=True))
            rows.append({"label": f"bare chunk_gla B{opts.batch} T{opts.length} P{opts.widths[0]}", "fwd_ms": ms})
        except Exception as e:
            rows.append({"label": "bare chunk_gla", "error": f"{type(e).__name__}: {str(e)[:200]}"})
    for B in opts.step_batches:
        y = scan_inputs(B, 1, opts.channels, opts.modes, opts.widths[0])
        state = y["initial_state"].clone()
        args = [y[n][:, 0] for n in _NAMES[:4]] + [ModalTables(*(y[n] for n in _NAMES[4:9]))]
        rows.append({"label": f"torch decode step B{B} P{opts.widths[0]}", "B": B,
                     "ms": summarize(time_fn(lambda a=args, s=state: spectral_scan_step(*a, s), 5, 50, dev))["ms"]})
    return rows
