"""Time es.ops.spectral_scan (fla backend) at B=8, T=2048, K=32, M=8, P=28: fwd and fwd+bwd, fp32 and bf16."""

import os
import sys

import torch

import elastic_ssm as es

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


def timed(fn, warm=3, reps=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


for dtype in (torch.float32, torch.bfloat16):
    x = inputs(dtype)
    fwd = timed(lambda: es.ops.spectral_scan(*x, backend="fla"))
    def fb():
        z, _ = es.ops.spectral_scan(*x, backend="fla")
        z.float().sum().backward()
    both = timed(fb)
    print(f"fla {str(dtype)[6:]:9s} B{B} T{T} K{K} M{M} P{P}: fwd {fwd:.3f} ms  fwd+bwd {both:.3f} ms", flush=True)
sys.exit(0)
