#!/usr/bin/env python3
"""Where the time goes: kernel-level profiles of the H200 workloads the GPU-speed issue targets.

``python3 scripts/gpu_profile.py [stage ...]`` with stages ``prefill2k``, ``prefill128k``, ``train``,
``decode`` (default: all, in that order). Each stage times its workload (CUDA events, median) and prints
the top kernels of one profiled call (torch.profiler, device time), so an optimisation can aim at the
largest entry. Random weights at the preset shapes, like the benchmarks. Writes ``$OUT/profile.txt``.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from elastic_ssm.bench.decode import EsshDecoder, summarize, time_fn  # noqa: E402
from elastic_ssm.bench.peers import build_essh  # noqa: E402
from elastic_ssm.bench.profiling import RunLog  # noqa: E402
from elastic_ssm.bench.profiling import top_kernels as _top_kernels  # noqa: E402
from elastic_ssm.config import ESSHConfig  # noqa: E402
from elastic_ssm.models.fast_decode import FastDecoder  # noqa: E402

OUT = Path(os.environ.get("OUT", "gpu_profile_out"))
log = RunLog(OUT / "profile.txt")


def top_kernels(fn, n: int = 18) -> None:
    _top_kernels(fn, n, log)


def prefill(T: int, profile_it: bool = True) -> None:
    model = build_essh(ESSHConfig.preset("1.5b"), torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
    with torch.inference_mode():
        fn = lambda: model(ids)
        t = summarize(time_fn(fn, 2, 3, torch.device("cuda")))
        log(f"prefill 1.5b T10 T={T}: {t['ms']:.2f} ms, {T / t['ms']:.1f} ktok/s "
            f"(peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB)")
        if profile_it:
            top_kernels(fn)


def train() -> None:
    model = build_essh(ESSHConfig.preset("370m"), torch.device("cuda"), None).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (8, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = summarize(time_fn(step, 3, 5, torch.device("cuda")))
    log(f"train 370m B=8 L=2048: {t['ms']:.1f} ms/step, {8 * 2048 / t['ms']:.1f} ktok/s "
        f"(peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB)")
    top_kernels(step, 25)


def decode() -> None:
    """Graph decode per (preset, tier, batch); at batch 1 / T10 every (out_layout, PDL) variant, PDL on vs
    off checked equal first, and the kernels of the default decoder."""
    dev = torch.device("cuda")
    for preset, tiers, batches in (("1.5b", ("T10", "T1"), (1, 128)), ("370m", ("T10", "T1"), (1,))):
        model = build_essh(ESSHConfig.preset(preset), dev, torch.bfloat16)
        for tier in tiers:
            for B in batches:
                tok = torch.randint(0, 1000, (B,), device=dev)
                variants = ([("auto", "auto")] if B > 1 or tier != "T10" else
                            [("auto", "auto"), ("split", True), ("split", False), ("rows", True), ("rows", False)])
                for layout, pdl in variants:
                    try:
                        d = EsshDecoder(model, tier, B, 2048, graph=True, out_layout=layout, pdl=pdl)
                        if pdl is True:   # a copy of the cache through ordinary launches: the same logits
                            e = FastDecoder(model, tier, B, cache=copy.deepcopy(d.cache), out_layout=layout,
                                            pdl=False, cuda_graph=True)
                            err = (d.step(tok).float() - e.step(tok).float()).abs().max().item()
                            log(f"  check {preset} {tier} {layout}: PDL vs ordinary launch max |diff| {err:.3g}")
                            e = None
                        t = summarize(time_fn(lambda d=d, tok=tok: d.step(tok), 20, 100, dev))
                        log(f"decode {preset} {tier} B={B} graph out_layout={layout} ({d.fd.out_layout}) "
                            f"pdl={d.fd.pdl}: {t['ms']:.3f} ms")
                        if B == 1 and tier == "T10" and pdl == "auto":
                            top_kernels(lambda d=d, tok=tok: d.step(tok), 12)
                        d = None
                    except Exception as e:  # report the variant and go on with the next
                        log(f"decode {preset} {tier} B={B} {layout} pdl={pdl} failed: {type(e).__name__}: "
                            f"{str(e)[:300]}")
        del model
        torch.cuda.empty_cache()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} backend "
        f"{os.environ.get('ELASTIC_SSM_SCAN_BACKEND', 'auto')}")
    stages = sys.argv[1:] or ["prefill2k", "prefill128k", "train", "decode"]
    fns = {"prefill2k": lambda: prefill(2048), "prefill128k": lambda: prefill(131072), "train": train,
           "decode": decode}
    for s in stages:
        try:
            fns[s]()
        except Exception as e:  # keep going: each stage is independent
            log(f"{s} failed: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
