"""Suite kinds of ``generate``'s own paths: ``session_prefill`` (its prefill, eager or graphed, per scan backend and
length) and ``generate_paths`` (the reference step against the fused torch path on the CPU)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from annotated_types import Len

from elastic_ssm.bench.decode import oom_as_result, summarize, time_fn, wall_ms
from elastic_ssm.config import ConfigBase, opt
from elastic_ssm.config.base import AtLeast1

__all__ = ["ScanBackend", "SessionPrefillOptions", "run_session_prefill", "GeneratePathsOptions",
           "run_generate_paths"]

#: ELASTIC_SSM_SCAN_BACKEND values a bench entry may set
ScanBackend = Literal["auto", "fla", "torch"]


@dataclass(kw_only=True)
class SessionPrefillOptions(ConfigBase):
    """``generate``'s own prefill, timed per scan backend and prompt length (random weights)."""

    preset: str = opt("1.5b", "ESSH preset (random weights)")
    tier: str = opt("T10", "tier of the pooled decoder")
    lengths: Annotated[tuple[AtLeast1, ...], Len(1)] = opt((2048, 131072), "prompt lengths (batch 1)")
    compile: bool = opt(False, "compile_model first: on CUDA the prefill replays the graph of the compiled trunk")
    scan_backends: tuple[ScanBackend, ...] = opt(("auto",), "ELASTIC_SSM_SCAN_BACKEND of each pass: auto (as the "
                                                    "environment says), fla, torch")
    repeats: AtLeast1 = opt(5, "timed prefills per length after the first (median)")
    device: str = opt("auto", "auto (cuda if available), cuda, cpu")



def run_session_prefill(opts: SessionPrefillOptions, ctx) -> list[dict]:
    """Rows ``{"backend", "compiled", "length", "first_call_s", "ms", "ktok_s", "generate_1_ms"}``
    (``generate_1_ms``: the median wall of ``model.generate(prompt, 1)``, the user's call around this prefill)."""
    from elastic_ssm.bench.decode import random_model
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models import compile_model
    from elastic_ssm.models.fast_decode import FusedSession
    from elastic_ssm.ops.dispatch import ENV_VAR

    dev = torch.device(opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = random_model(ESSHConfig.preset(opts.preset), dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if opts.compile:
        compile_model(model)
    rows, before = [], os.environ.get(ENV_VAR)
    try:
        for backend in opts.scan_backends:
            if backend != "auto":
                os.environ[ENV_VAR] = backend
            for T in opts.lengths:
                if ctx.time_left() <= 0:
                    rows.append({"backend": backend, "length": T, "error": "skipped: time budget"})
                    continue
                row: dict = {"backend": backend, "compiled": opts.compile, "length": T}
                ids = torch.randint(0, model.config.vocab_size, (1, T), device=dev)
                with oom_as_result(row, dev, peak=True), torch.no_grad():
                    session = FusedSession(model, 1, opts.tier, None, None)
                    call = lambda s=session, x=ids: s.prefill(x, None)
                    row["first_call_s"] = wall_ms(call, dev) / 1e3
                    row["ms"] = summarize(time_fn(call, 0, opts.repeats, dev))["ms"]
                    row["ktok_s"] = T / row["ms"]
                    gen = lambda x=ids: model.generate(x, 1, tier=opts.tier)
                    row["generate_1_ms"] = summarize(time_fn(gen, 0, opts.repeats, dev))["ms"]
                ctx.log(f"  prefill {opts.preset} {opts.tier} {backend} compiled={opts.compile} T={T}: {row}")
                rows.append(row)
                model.clear_decoders()
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
    return rows


@dataclass(kw_only=True)
class GeneratePathsOptions(ConfigBase):
    """Reference step vs fused torch path of ``generate`` on the CPU."""

    presets: tuple[str, ...] = opt(("tiny", "small"), "ESSH presets (random weights)")
    prompt: AtLeast1 = opt(64, "prompt tokens")
    new_tokens: AtLeast1 = opt(32, "tokens whose cost is averaged")
    repeats: AtLeast1 = opt(7, "measurements per path (median)")
    threads: AtLeast1 = opt(1, "torch CPU threads")



def _cpu_ms_per_token(model, x: torch.Tensor, fast: bool, n: int) -> float:
    model.generate(x, 2, fast=fast)
    t = time.process_time()
    model.generate(x, n + 1, fast=fast)
    whole = time.process_time() - t
    t = time.process_time()
    model.generate(x, 1, fast=fast)
    return (whole - (time.process_time() - t)) / n * 1e3


def run_generate_paths(opts: GeneratePathsOptions, ctx) -> list[dict]:
    """A row per (preset, path): ``{"preset", "path", "ms_per_token"}``."""
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models.essh import ESSH, randomize_selective

    threads = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    rows = []
    try:
        for preset in opts.presets:
            model = randomize_selective(ESSH(ESSHConfig.preset(preset)).eval(), ffn_out_std=0.1)
            x = torch.randint(0, model.config.vocab_size, (1, opts.prompt))
            times: dict[str, list[float]] = {"reference": [], "fused-torch": []}
            for _ in range(opts.repeats):
                times["reference"].append(_cpu_ms_per_token(model, x, False, opts.new_tokens))
                times["fused-torch"].append(_cpu_ms_per_token(model, x, True, opts.new_tokens))
            rows += [{"preset": preset, "path": k, "ms_per_token": statistics.median(v)} for k, v in times.items()]
    finally:
        torch.set_num_threads(threads)
    return rows
