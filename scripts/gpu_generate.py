#!/usr/bin/env python3
"""One H200 run of the user's generation path (issue #18 targets); stages chosen by ``GPU_GEN_STAGES``.

Run from the repository root on the GPU machine with fla-core importable. Prints, flushed, one line per
result, and writes ``$OUT/generate.json``. Stages (comma-separated names, default all, in this order):

* ``tests``: ``pytest -m gpu`` of tests/test_generate_gpu.py, test_fast_decode_gpu.py and
  test_es_ssm_decode_bench.py (torch scan backend, as CONTRIBUTING says);
* ``generate``: ``elastic-ssm bench`` generate entries, eager prefill: 370m T10 batch 1, 1.5b T10 batch 1
  and 128 (2K prompt, 128 new tokens), each with the pooled decoder's graph step beside it;
* ``compiled``: the same for 1.5b T10 batch 1 with ``compile_model`` (graphed compiled prefill), and the
  graphed compiled prefill alone at 2K and 128K tokens (ktok/s, CUDA events around the replayed call);
* ``process``: a saved 1.5b model; three fresh processes each load it and make the first token of a
  2K prompt, timed by phase (the later ones find Triton's kernel and autotuning caches), then
  ``elastic-ssm generate`` end to end (load, 2K-character prompt, 256 tokens, greedy), wall clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp/gpu_generate"))
OUT.mkdir(parents=True, exist_ok=True)
STAGES = [s for s in os.environ.get("GPU_GEN_STAGES", "tests,generate,compiled,process").split(",") if s]
RESULTS: dict = {}


def log(*a) -> None:
    print(*a, flush=True)


def stage_tests() -> None:
    env = {**os.environ, "ELASTIC_SSM_SCAN_BACKEND": "torch"}
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/test_generate_gpu.py",
                        "tests/test_fast_decode_gpu.py", "tests/test_es_ssm_decode_bench.py", "-p",
                        "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-25:]
    log("\n".join(tail))
    RESULTS["tests"] = {"rc": r.returncode, "s": time.time() - t, "tail": tail[-3:]}


def _bench(preset: str, batches, compile_: bool) -> list[dict]:
    from elastic_ssm.bench import BenchConfig, run_bench

    cfg = BenchConfig(preset=preset, benchmarks=("generate",), generate_batches=tuple(batches), peers=(),
                      compile=compile_, out="", generate_iters=3)
    return run_bench(cfg, log=log, print_tables=False)["generate"]


def stage_generate() -> None:
    RESULTS["generate"] = _bench("370m", (1,), False) + _bench("1.5b", (1, 128), False)


def _prefill_ms(session, ids, repeats: int) -> float:
    """Median CUDA-event time of ``session.prefill(ids)`` over ``repeats`` calls, in ms."""
    import torch

    from elastic_ssm.bench.decode import summarize

    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        session.prefill(ids, None)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return summarize(times)["ms"]


def stage_compiled() -> None:
    import torch

    from elastic_ssm.bench.peers import build_essh
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models import compile_model
    from elastic_ssm.models.decode_engine import FusedSession

    RESULTS["compiled_generate"] = _bench("1.5b", (1,), True)
    model = compile_model(build_essh(ESSHConfig.preset("1.5b"), torch.device("cuda"), torch.bfloat16))
    rows = []
    for T in (2048, 131072):
        ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
        session = FusedSession(model, 1, "T10", None, None)
        t0 = time.perf_counter()
        session.prefill(ids, None)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = _prefill_ms(session, ids, 5)
        row = {"length": T, "first_call_s": first, "ms": ms, "ktok_s": T / ms}
        log("compiled graphed prefill 1.5b T10", row)
        rows.append(row)
        model.clear_decoders()
    RESULTS["compiled_prefill"] = rows


_CHILD = """
import time, sys
t0 = time.perf_counter()
import torch, elastic_ssm as es
from elastic_ssm.models.decode_engine import FusedSession
t_imp = time.perf_counter()
m = es.ESSH.from_pretrained(sys.argv[1], tier="T10", device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t_load = time.perf_counter()
ids = torch.randint(0, m.config.vocab_size, (1, 2048), device="cuda")
s = FusedSession(m, 1, None, None, None)      # the loaded T10 model is standalone: its only tier
torch.cuda.synchronize()
t_dec = time.perf_counter()
with torch.inference_mode():
    tok = s.prefill(ids, None).argmax(-1)
torch.cuda.synchronize()
t_pre = time.perf_counter()
print(f"RESULT import_s={t_imp - t0:.2f} load_s={t_load - t_imp:.2f} decoder_s={t_dec - t_load:.2f} "
      f"prefill_s={t_pre - t_dec:.2f} first_token_s={t_pre - t0:.2f}")
t = time.perf_counter()
m.generate(ids, 1)
torch.cuda.synchronize()
print(f"RESULT next generate(2K prompt, 1 token) {time.perf_counter() - t:.3f}s")
"""


def _child(script: str, *args: str, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    return " | ".join(line) if line else (r.stderr.strip().splitlines() or ["?"])[-1]


def stage_process() -> None:
    import torch

    from elastic_ssm.bench.peers import build_essh
    from elastic_ssm.config import ESSHConfig

    d = Path("/tmp/essh15b")
    if not (d / "config.json").exists():
        build_essh(ESSHConfig.preset("1.5b"), torch.device("cuda"), torch.bfloat16).save_pretrained(d)
    runs = []
    for i in range(3):
        runs.append(_child(_CHILD, str(d)))
        log(f"process {i + 1}: {runs[-1]}")
    prompt = ("def main(argv):\n    return argv\n" * 80)[:2048]
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "elastic_ssm.cli", "generate", str(d), "--tier", "T10",
                        "--prompt", prompt, "--max-new-tokens", "256", "--temperature", "0"], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    log(f"elastic-ssm generate 1.5b T10 end to end: rc={r.returncode} wall={wall:.2f}s; "
        f"stderr: {r.stderr.strip().splitlines()[-1:]}")
    RESULTS["process"] = {"children": runs, "cli_wall_s": wall, "cli_rc": r.returncode}


_IMPORT_FLA = """
import importlib.util, os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fla.ops.gla
t2 = time.perf_counter()
import torch._dynamo as d
pyc = importlib.util.cache_from_source(d.__file__)
print(f"RESULT torch_s={t1 - t0:.2f} fla_s={t2 - t1:.2f} dynamo_pyc={os.path.exists(pyc)} "
      f"site_writable={os.access(os.path.dirname(d.__file__), os.W_OK)} "
      f"dontwrite={sys.flags.dont_write_bytecode}")
"""


def stage_firsttoken() -> None:
    """A new process's first token by phase with each scan backend for the prefill, the cost of importing
    fla alone, and the eager 2K / 16K prefill of 1.5b T10 with each backend (CUDA events, warm)."""
    import torch

    from elastic_ssm.bench.peers import build_essh
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.models.decode_engine import FusedSession

    d = Path("/tmp/essh15b")
    model = build_essh(ESSHConfig.preset("1.5b"), torch.device("cuda"), torch.bfloat16)
    if not (d / "config.json").exists():
        model.save_pretrained(d)
    rows = {}
    torch.set_grad_enabled(False)
    for backend in ("fla", "torch"):
        os.environ["ELASTIC_SSM_SCAN_BACKEND"] = backend
        for T in (2048, 16384):
            ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
            session = FusedSession(model, 1, "T10", None, None)
            session.prefill(ids, None)
            rows[f"{backend} {T}"] = _prefill_ms(session, ids, 3)
            log(f"eager prefill 1.5b T10 {backend} T={T}: {rows[f'{backend} {T}']:.2f} ms")
            model.clear_decoders()
    os.environ.pop("ELASTIC_SSM_SCAN_BACKEND")
    del model
    torch.cuda.empty_cache()
    out = {"prefill_ms": rows, "children": []}
    for _ in range(2):
        out["children"].append(f"import fla: {_child(_IMPORT_FLA)}")
        log(out["children"][-1])
    for backend in ("fla", "torch", "fla", "torch"):
        env = {"ELASTIC_SSM_SCAN_BACKEND": backend}
        out["children"].append(f"{backend}: {_child(_CHILD, str(d), env=env)}")
        log(out["children"][-1])
    RESULTS["firsttoken"] = out


_PROFILE = """
import cProfile, pstats, sys, time, torch, elastic_ssm as es
from elastic_ssm.models.decode_engine import FusedSession
m = es.ESSH.from_pretrained(sys.argv[1], tier="T10", device="cuda", dtype=torch.bfloat16)
ids = torch.randint(0, m.config.vocab_size, (1, 2048), device="cuda")
s = FusedSession(m, 1, None, None, None)
torch.cuda.synchronize()
t = time.perf_counter()
cProfile.run("s.prefill(ids, None); torch.cuda.synchronize()", "/tmp/prefill.prof")
print(f"first prefill {time.perf_counter() - t:.2f}s")
pstats.Stats("/tmp/prefill.prof").sort_stats("cumtime").print_stats(30)
pstats.Stats("/tmp/prefill.prof").sort_stats("tottime").print_stats(15)
"""


def stage_profile() -> None:
    """Where a fresh process's first prefill spends its time (after ``process`` warmed the caches)."""
    env = {**os.environ, "TRITON_PRINT_AUTOTUNING": "1"}
    r = subprocess.run([sys.executable, "-c", _PROFILE, "/tmp/essh15b"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    (OUT / "profile.txt").write_text(r.stdout + r.stderr)
    lines = r.stdout.splitlines()
    log("\n".join(lines[:60]))
    log(f"autotuning lines printed: {sum('autotun' in x.lower() for x in (r.stdout + r.stderr).splitlines())}")


def stage_scan() -> None:
    """The fla scan against its float64 reference after the edge-value changes (a subset: fla autotunes per
    shape, minutes on a fresh machine)."""
    sel = "reference_at_preset_widths or auto_backend or torch_path or long_sequence or (reference and 130)"
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/test_spectral_scan_gpu.py", "-k",
                        sel, "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                       timeout=float(os.environ.get("GPU_GEN_SCAN_TIMEOUT", "240")))
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    log("\n".join(tail))
    RESULTS["scan"] = {"rc": r.returncode, "tail": tail[-3:]}


def main() -> None:
    import torch

    log(f"device {torch.cuda.get_device_name(0)}; torch {torch.__version__}; stages {STAGES}")
    for name in STAGES:
        t = time.time()
        try:
            globals()[f"stage_{name}"]()
        except Exception as e:  # one failing stage must not lose the others' results
            import traceback

            traceback.print_exc()
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"== stage {name}: {time.time() - t:.1f}s")
        (OUT / "generate.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
