"""Time es.ops.spectral_scan (fla backend) at B=8, T=2048, K=32, M=8, P=28: fwd and fwd+bwd, fp32 and bf16."""

import os
import sys

import torch

import elastic_ssm as es

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_scan_check import timed  # noqa: E402  (median ms over warm repetitions, CUDA events)

B, T, K, M, P = 8, 2048, 32, 8, int(os.environ.get("P", 28))
dev = "cuda"


def inputs(dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.rand(*s, device=dev, generator=g)
    v = torch.randn(B, T, K, P, device=dev, generator=g).to(dtype)
    gates = [(2 * r(B, T, K, M)).to(dtype) for _ in range(2)]
    clock = torch.nn.functional.softplus(torch.randn(B, T, K, M, device=dev, generator=g) - 3).to(dtype)
    tabs = [0.9 + 0.1 * r(K, M), r(K, M), r(K, M) - 0.5, r(K, M) - 0.5, 0.5 + 0 * r(K, M)]
    return [t.requires_grad_() for t in (v, *gates, clock, *tabs)]


def fwd_bwd(x):
    z, _ = es.ops.spectral_scan(*x, backend="fla")
    z.float().sum().backward()


for dtype in (torch.float32, torch.bfloat16):
    x = inputs(dtype)
    fwd = timed(lambda x=x: es.ops.spectral_scan(*x, backend="fla"))
    both = timed(lambda x=x: fwd_bwd(x))
    name = str(dtype)[6:]
    print(f"fla {name:9s} B{B} T{T} K{K} M{M} P{P}: fwd {fwd:.3f} ms  fwd+bwd {both:.3f} ms", flush=True)
