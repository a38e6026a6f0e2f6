"""Where the time goes: the top device-time kernels of one call (torch.profiler) and suite kind ``profile``
(one workload, prefill / train / decode at a preset, timed and profiled)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from elastic_ssm.config import ConfigBase, opt
from elastic_ssm.config.base import AtLeast1, NonNeg

__all__ = ["top_kernels", "torch_profiled", "ProfileOptions", "run_profile"]


def top_kernels(fn: Callable[[], object], n: int = 15, log: Callable[[str], None] = print) -> list[dict]:
    """Profile one call of ``fn`` (CUDA activity only) and ``log`` a summary line and the ``n`` kernels with
    the most self device time; returns those rows as ``{"name", "ms", "count"}``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows)
    rows.sort(key=lambda e: -e.self_device_time_total)
    log(f"  profile: {len(rows)} kernel kinds, {sum(e.count for e in rows)} launches, "
        f"{total / 1e3:.2f} ms device time")
    out = []
    for e in rows[:n]:
        log(f"  {e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:90]}")
        out.append({"name": e.key, "ms": e.self_device_time_total / 1e3, "count": e.count})
    return out


@contextmanager
def torch_profiled(phase: str, tables: list[str], rows: int = 40) -> Iterator[None]:
    """The block under ``torch.profiler`` (CPU, and CUDA where there is CUDA): its ops by self CPU time and by
    device time (by CPU time without CUDA), ``rows`` each, appended to ``tables`` under a ``== phase`` header."""
    from torch.profiler import ProfilerActivity, profile

    t = time.time()
    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        yield
    avg = prof.key_averages()
    tables.append(f"== {phase}: {time.time() - t:.3f} s under the profiler, by self CPU time\n"
                  + avg.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)
                  + f"\n== {phase}, by {'CUDA' if cuda else 'CPU'} time\n"
                  + avg.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows,
                              max_name_column_width=70))


@dataclass(kw_only=True)
class ProfileOptions(ConfigBase):
    """One workload timed (CUDA events, median) and profiled (top kernels by device time), random weights."""

    workload: Literal["prefill", "train", "decode"] = opt(
        "prefill", "prefill (batch 1, `length` tokens), train (one fused-AdamW step, bf16 autocast), decode (graph "
                   "FastDecoder step after a `length` context)")
    preset: str = opt("1.5b", "ESSH preset")
    tier: str = opt("T10", "tier (prefill, decode)")
    length: AtLeast1 = opt(2048, "prompt length (prefill), context (decode), sequence length (train)")
    batch: AtLeast1 = opt(1, "batch (train: micro-batch, decode: sequences)")
    compile: bool = opt(False, "compile_model first (prefill, train; the loss too)")
    compile_mode: str = opt("default", "torch.compile mode with compile (reduce-overhead: CUDA graphs)")
    backend: Literal["auto", "triton", "torch"] = opt("auto", "decode: FastDecoder kernels (auto, triton, torch)")
    out_layout: Literal["auto", "split", "rows"] = opt("auto", "decode: FastDecoder out_layout (auto: split for "
                                                       "Triton without PDL, else rows; split, rows)")
    pdl: Literal["auto", "on", "off"] = opt("auto", "decode: programmatic dependent launch (auto, on, off)")
    warmup: NonNeg = opt(2, "untimed calls (absorb compilation and autotuning)")
    iters: AtLeast1 = opt(5, "timed calls (median)")
    top: NonNeg = opt(15, "kernels listed from one profiled call (0: timing only)")


def _workload(opts: ProfileOptions, dev: torch.device):
    """(fn, tokens per call) of the workload."""
    from elastic_ssm.bench.decode import random_model
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models import compile_model

    cfg = ESSHConfig.preset(opts.preset)
    if opts.workload == "decode":
        from elastic_ssm.bench.decode import EsshDecoder

        d = EsshDecoder(random_model(cfg, dev, torch.bfloat16), opts.tier, opts.batch, opts.length,
                        graph=dev.type == "cuda", backend=opts.backend, out_layout=opts.out_layout,
                        pdl={"auto": "auto", "on": True, "off": False}[opts.pdl])
        tok = torch.randint(0, cfg.vocab_size, (opts.batch,), device=dev)
        return (lambda: d.step(tok)), opts.batch
    kw = {} if opts.compile_mode == "default" else {"mode": opts.compile_mode}
    model = random_model(cfg, dev, torch.bfloat16 if opts.workload == "prefill" else None)
    if opts.compile:
        compile_model(model, **kw)
    ids = torch.randint(0, cfg.vocab_size, (opts.batch, opts.length), device=dev)
    if opts.workload == "prefill":
        def prefill():
            with torch.inference_mode():
                model(ids, tier=opts.tier)
        return prefill, opts.batch * opts.length
    opt_ = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    loss = lambda lg, y: torch.nn.functional.cross_entropy(lg[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten())
    loss_fn = torch.compile(loss, dynamic=False) if opts.compile else loss
    model.train()

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = loss_fn(model(ids), ids)
        out.backward()
        opt_.step()
        opt_.zero_grad(set_to_none=True)
    return step, opts.batch * opts.length


def run_profile(opts: ProfileOptions, ctx) -> list[dict]:
    """One row: ``ms`` (median), ``ktok_s``, ``peak_gb``, and with ``top`` the profiled call's kernel kinds,
    launches and device ms; the kernel list goes to the log and ``kernels.json``."""
    from elastic_ssm.bench.decode import summarize, time_fn

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row: dict = {"workload": opts.workload, "preset": opts.preset, "tier": opts.tier, "length": opts.length,
                 "batch": opts.batch, "compiled": opts.compile}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fn, tokens = _workload(opts, dev)
    t = time.monotonic()
    fn()
    row["first_call_s"] = time.monotonic() - t
    row.update(summarize(time_fn(fn, opts.warmup, opts.iters, dev)))
    row["ktok_s"] = tokens / row["ms"]
    if dev.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if opts.top:
            kernels = top_kernels(fn, opts.top, ctx.log)
            ctx.save_json("kernels.json", kernels)
            row["top_kernel"] = kernels[0]["name"][:60] if kernels else None
    return [row]
