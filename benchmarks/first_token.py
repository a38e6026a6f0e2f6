"""A fresh process's first token by phase (kind ``first_token``): children ``python -m benchmarks.first_token``
(flags of ``ChildOptions``) time import, load, decoder and first prefill from the moment the parent started them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Len

from benchmarks.generate_paths import ScanBackend
from elastic_ssm.config import ConfigBase, opt
from elastic_ssm.config.base import AtLeast1, NonNeg

__all__ = ["ChildOptions", "FirstTokenOptions", "run_first_token", "saved_model"]


@dataclass(kw_only=True)
class FirstTokenOptions(ConfigBase):
    """Fresh processes' first token by phase, per scan backend."""

    preset: str = opt("1.5b", "ESSH preset of the saved random-weight model")
    tier: str = opt("T10", "tier the children load")
    model_dir: str = opt("", "model folder to load (saved there first if it has no config.json); '' = "
                             "<temp dir>/elastic_ssm_bench/<preset>")
    prompt: AtLeast1 = opt(2048, "prompt tokens of the first prefill")
    runs: NonNeg = opt(3, "children per scan backend, one after another")
    scan_backends: Annotated[tuple[ScanBackend, ...], Len(1)] = opt(
        ("auto",), "ELASTIC_SSM_SCAN_BACKEND of the children: auto (as the environment says), fla, torch; runs cycle "
        "through them")
    import_fla: NonNeg = opt(0, "children that only import fla first (startup and fla import seconds)")
    cprofile: bool = opt(False, "one more child with its load, decoder build and first prefill under cProfile "
                                "(profile.txt; Triton prints its autotuning)")
    torch_profile: bool = opt(False, "one more child with its decoder build and first prefill under torch.profiler, "
                                     "CPU and CUDA (torch_profile.txt: each phase's ops by self CPU time)")
    cli_tokens: NonNeg = opt(0, "then `elastic-ssm generate` end to end: prompt of `prompt` characters, this many "
                             "greedy tokens (0: not run)")
    compile: bool = opt(False, "the children call compile_model before the first prefill (the compiled trunk's "
                               "graph; later children find the compile caches on disk)")
    device: str = opt("cuda", "device of the children")
    timeout_s: float = opt(600.0, "limit of one child")



def saved_model(preset: str, model_dir: str = "", device: str = "cuda") -> Path:
    """``model_dir`` (or the default temp folder) holding a random-weight bf16 ``preset`` model, saved once."""
    d = Path(model_dir) if model_dir else Path(tempfile.gettempdir()) / "elastic_ssm_bench" / preset
    if not (d / "config.json").is_file():
        import torch

        from elastic_ssm.bench.decode import random_model
        from elastic_ssm.config import ESSHConfig

        dev = torch.device(device if device != "cuda" or torch.cuda.is_available() else "cpu")
        model = random_model(ESSHConfig.preset(preset), dev, torch.bfloat16)
        model.save_pretrained(d)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return d


@dataclass(kw_only=True)
class ChildOptions:
    """One child process: what it measures and what it loads."""

    mode: Literal["first-token", "import-fla"] = opt("first-token", "first-token: load, prefill, first token; "
                                                                    "import-fla: only import fla")
    model: str = opt("", "model folder (first-token)")
    tier: str = opt("T10", "tier to load")
    prompt: int = opt(2048, "prompt tokens")
    device: str = opt("cuda", "where the model runs")
    cprofile: str = opt("", "write a cProfile of the prefill here")
    torch_profile: str = opt("", "write torch.profiler tables of the decoder build and the prefill here")
    compile: bool = opt(False, "compile_model after loading")
    spawned_at: float | None = opt(None, "time.time() when the parent started us")


def _child(opts: ChildOptions, ctx, env: dict[str, str], timeout: float, log_name: str) -> dict:
    """One ``python -m benchmarks.first_token ...`` child; its ``RESULT {json}`` line, or the error."""
    from elastic_ssm.cli_util import to_argv

    cmd = [sys.executable, "-m", "benchmarks.first_token", *to_argv(replace(opts, spawned_at=time.time()))]
    try:
        p = subprocess.run(cmd, env=ctx.child_env(env), capture_output=True, text=True,
                           timeout=max(1.0, min(timeout, ctx.time_left())))
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    with ctx.path(log_name).open("a") as f:
        f.write(" ".join(cmd) + "\n" + out + err + "\n")
    found = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
    if found:
        return json.loads(found[-1])
    return {"error": ((err or out).strip().splitlines() or ["no output"])[-1][-300:]}


def run_first_token(opts: FirstTokenOptions, ctx) -> list[dict]:
    """Rows: ``{"probe": "first token", "run", "backend", "warm", "import_s", "load_s", "decoder_s",
    "prefill_s", "first_token_s", "next_generate_s"}``, ``{"probe": "import fla", ...}`` and
    ``{"probe": "elastic-ssm generate", "rc", "wall_s"}``."""
    d = saved_model(opts.preset, opts.model_dir, opts.device)
    rows: list[dict] = []
    for i in range(opts.import_fla):
        rows.append({"probe": "import fla", "run": i + 1, **_child(ChildOptions(mode="import-fla"), ctx, {},
                                                                   opts.timeout_s, "children.log")})
        ctx.log(f"  {rows[-1]}")
    base = ChildOptions(model=str(d), tier=opts.tier, prompt=opts.prompt, device=opts.device, compile=opts.compile)
    n = 0
    for i in range(opts.runs):
        for backend in opts.scan_backends:
            if ctx.time_left() <= 0:
                rows.append({"probe": "first token", "run": i + 1, "backend": backend, "error": "skipped: time budget"})
                continue
            env = {} if backend == "auto" else {"ELASTIC_SSM_SCAN_BACKEND": backend}
            res = _child(base, ctx, env, opts.timeout_s, "children.log")
            rows.append({"probe": "first token", "run": i + 1, "backend": backend, "warm": n > 0,
                         "compiled": opts.compile, **res})
            n += 1
            ctx.log(f"  {rows[-1]}")
            if res.get("torch_pyc") is False and n == 1:
                ctx.log("  torch has no .pyc here (PYTHONDONTWRITEBYTECODE=1 on an install without them?): import_s "
                        "is not a pip install's; byte-compile site-packages first (docs/performance.md)")
    if opts.cprofile:
        env = {"TRITON_PRINT_AUTOTUNING": "1"}
        res = _child(replace(base, cprofile=str(ctx.path("profile.txt"))), ctx, env, opts.timeout_s, "children.log")
        rows.append({"probe": "first token, cProfile", "backend": "auto", "warm": n > 0, **res})
    if opts.torch_profile:
        res = _child(replace(base, torch_profile=str(ctx.path("torch_profile.txt"))), ctx, {}, opts.timeout_s,
                     "children.log")
        rows.append({"probe": "first token, torch.profiler", "backend": "auto", "warm": n > 0, **res})
    if opts.cli_tokens:
        prompt = ("def main(argv):\n    return argv\n" * (opts.prompt // 30 + 1))[:opts.prompt]
        cmd = [sys.executable, "-m", "elastic_ssm.cli", "generate", str(d), "--tier", opts.tier, "--prompt", prompt,
               "--max_new_tokens", str(opts.cli_tokens), "--temperature", "0"]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=ctx.child_env(), capture_output=True, text=True,
                               timeout=max(1.0, min(opts.timeout_s, ctx.time_left())))
            rc, last = p.returncode, (p.stderr.strip().splitlines() or [""])[-1][-200:]
        except subprocess.TimeoutExpired:
            rc, last = "timeout", ""
        rows.append({"probe": "elastic-ssm generate", "tokens": opts.cli_tokens, "rc": rc,
                     "wall_s": time.perf_counter() - t, "last_line": last})
        ctx.log(f"  {rows[-1]}")
    return rows


# ---- the child processes ---------------------------------------------------------------------------------
def _first_token_child(a: ChildOptions) -> dict:
    import torch

    import elastic_ssm as es
    from elastic_ssm.models.fast_decode import FusedSession
    from elastic_ssm.utils.progress import tuning_notice

    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    t_imp = time.time()
    prof = None
    if a.cprofile:                               # load, decoder build and first prefill under cProfile
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    m = es.ESSH.from_pretrained(a.model, tier=a.tier, device=a.device, dtype=torch.bfloat16)
    if a.compile:
        es.compile_model(m)
    sync()
    t_load = time.time()
    ids = torch.randint(0, m.config.vocab_size, (1, a.prompt), device=a.device)
    tables = []
    with tuning_notice(torch.device(a.device)):   # as generate: a fresh machine's first decoder and prefill say so
        with _torch_profiled(a.torch_profile, "decoder build", tables):
            s = FusedSession(m, 1, None, None, None)  # a model loaded at a tier is standalone: its only tier
            sync()
        t_dec = time.time()
        with _torch_profiled(a.torch_profile, "first prefill", tables), torch.inference_mode():
            s.prefill(ids, None).argmax(-1)       # logits: it waits for the deferred weights checksum
            sync()
        t_pre = time.time()
    if tables:
        Path(a.torch_profile).write_text("\n\n".join(tables))
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(60)
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=buf).print_callers("entry_points|capture_graph|_do_compile")  # who pays them
        Path(a.cprofile).write_text(buf.getvalue())
    m.generate(ids, 1)
    sync()
    return {"import_s": t_imp - a.spawned_at, "load_s": t_load - t_imp, "decoder_s": t_dec - t_load,
            "prefill_s": t_pre - t_dec, "first_token_s": t_pre - a.spawned_at, "next_generate_s": time.time() - t_pre,
            "dynamo_imported": "torch._dynamo" in sys.modules, "torch_pyc": _has_bytecode(torch.__file__)}


def _has_bytecode(source: str) -> bool:
    """Whether ``source`` has its cached ``.pyc`` (as ``pip install`` leaves one): without it, as under
    ``PYTHONDONTWRITEBYTECODE=1`` on an image installed with ``--no-compile``, every process compiles the module
    again and "import" is not what a user measures (docs/performance.md)."""
    import importlib.util

    return Path(importlib.util.cache_from_source(source)).exists()


@contextmanager
def _torch_profiled(path: str, phase: str, tables: list[str]):
    """With ``path``: the block under ``benchmarks.profiling.torch_profiled`` (imported only then: the child times
    its own imports); else the block alone."""
    if not path:
        yield
        return
    from benchmarks.profiling import torch_profiled

    with torch_profiled(phase, tables):
        yield


def _import_fla_child(a: ChildOptions) -> dict:
    import importlib.util

    t1 = time.time()
    import fla.ops.gla  # noqa: F401
    import torch._dynamo as dynamo

    t2 = time.time()
    pyc = importlib.util.cache_from_source(dynamo.__file__)
    return {"startup_s": t1 - a.spawned_at, "fla_s": t2 - t1, "dynamo_pyc": os.path.exists(pyc),
            "site_writable": os.access(os.path.dirname(dynamo.__file__), os.W_OK),
            "dont_write_bytecode": bool(sys.flags.dont_write_bytecode)}


def _main(argv: list[str] | None = None) -> None:
    from elastic_ssm.cli_util import derive

    a = derive(ChildOptions, argv, "python -m benchmarks.first_token", __doc__.splitlines()[0])
    if a.spawned_at is None:
        a.spawned_at = time.time()
    res = _first_token_child(a) if a.mode == "first-token" else _import_fla_child(a)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    _main()
