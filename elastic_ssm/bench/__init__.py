"""``elastic-ssm bench``: ``BenchConfig``, ``run_bench`` (decode, prefill, generate, train and serve of ESSH tiers
against parameter-matched peers, random weights at the preset shapes; docs/performance.md) and ``bench_command`` (one
run, or a suite of the research harness: ``benchmarks/suite.py`` of a clone, whose ``bench`` entries call
``run_bench``).

Finding the research harness (``benchmarks/`` at the repository root, not installed) from a clone: the suites of
``elastic-ssm bench --bench.suite`` (``benchmarks/suite.py``), their entry kinds (``benchmarks/kinds.py``) and the fla
peers (``benchmarks/fla_peers.py``) are imported by name, from the current folder or the checkout this
``elastic_ssm`` is imported from when they are not importable, else a one-line ``ConfigError``."""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from annotated_types import Ge

from ..config import ConfigBase, ConfigError, ESSHConfig, opt
from ..config.base import AtLeast1, NonNegF
from ..utils.environment import environment
from ..utils.files import atomic_write_text
from ..utils.progress import format_table

__all__ = ["BenchConfig", "run_bench", "bench_command", "Peer", "HARNESS", "CHECKOUT", "harness_roots",
           "harness_module", "COLUMNS", "environment", "format_table", "ratios", "tables", "write_json",
           "markdown_section", "append_markdown"]

Bench = Literal["decode", "prefill", "generate", "train", "serve"]   # in run order
_BENCHES = get_args(Bench)
_DEFAULT_BENCHES = _BENCHES[:4]   # serve (a server process and client processes): asked for by name
Peer = Literal["transformer", "gated_deltanet", "mamba2"]


@dataclass(kw_only=True)
class BenchConfig(ConfigBase):
    """What ``elastic-ssm bench`` measures and how (defaults: the paper's H200 protocol, Appendix R)."""

    suite: str = opt("", "run a suite instead: a name under configs/bench/ (generate, train-2gpu, h200, ...; "
                     "'list' lists them) or a YAML path; other flags given override that option in every entry "
                     "that has it")
    only: tuple[str, ...] = opt((), "suite: run only the entries with these names (glob patterns, separated by "
                                "spaces or commas, the flag repeatable; also entries marked optional)",
                                repeatable=True)
    set: tuple[str, ...] = opt((), "suite: entry options as [ENTRY.]KEY=VALUE (VALUE read as YAML), e.g. "
                               "combos.steps=4 or model=runs/x/final; several after one flag or the flag "
                               "repeated", repeatable=True)
    out_dir: str = opt("bench_out", "suite: folder of <suite>.json, <suite>.md and each entry's files (logs, "
                       "child outputs, plots); pass $OUT on the device machine")
    preset: str = opt("370m", "ESSH preset whose shapes are benchmarked with random weights")
    benchmarks: tuple[Bench, ...] = opt(_DEFAULT_BENCHES, "benchmarks to run: decode, prefill, generate, train; "
                                      "serve (streams against a server process) on request")
    tiers: tuple[str, ...] = opt(("T1", "T4", "T7", "T10"), "ESSH tiers to decode ('all': every tier)")
    peers: tuple[Peer, ...] = opt(get_args(Peer), "peers: transformer (ours), gated_deltanet / mamba2 (fla + FFN)")
    batches: tuple[AtLeast1, ...] = opt((1, 16, 128, 512), "decode batch sizes (CUDA-graph mode)")
    eager_batches: tuple[AtLeast1, ...] = opt((1,), "batch sizes also timed in eager mode")
    graph: bool = opt(True, "time decode with whole-step CUDA graphs (CUDA only)")
    reference: bool = opt(True, "also time the unfused reference ESSH.step (eager, batch 1, full tier)")
    context: int = opt(2048, "tokens already in the decode cache")
    warmup: int = opt(50, "untimed decode steps per session")
    iters: AtLeast1 = opt(200, "timed decode steps per session")
    sessions: int = opt(1, "decode timing sessions per entry (paper: 3)")
    prefill_lengths: tuple[int, ...] = opt((2048, 8192, 32768, 131072), "batch-1 prefill prompt lengths")
    prefill_tiers: tuple[str, ...] = opt(("T10",), "ESSH tiers to prefill")
    prefill_warmup: int = opt(3, "untimed prefill calls")
    prefill_iters: AtLeast1 = opt(5, "timed prefill calls")
    generate_tiers: tuple[str, ...] = opt(("T10",), "ESSH tiers timed through model.generate")
    generate_batches: tuple[AtLeast1, ...] = opt((1,), "model.generate batch sizes")
    generate_prompt: AtLeast1 = opt(2048, "model.generate prompt tokens")
    generate_new_tokens: Annotated[int, Ge(2)] = opt(128, "model.generate new tokens per call")
    generate_iters: AtLeast1 = opt(3, "timed model.generate calls per entry (median)")
    serve_mixes: tuple[str, ...] = opt(("T10", "T1,T4,T10"), "serve: tier mixes (comma-separated tiers; the "
                                       "streams cycle through a mix)")
    serve_streams: tuple[AtLeast1, ...] = opt((128,), "serve: concurrent client streams")
    serve_slots: AtLeast1 = opt(128, "serve: slots of the one pool every tier shares (its decode batch)")
    serve_prompt: AtLeast1 = opt(128, "serve: prompt tokens per request")
    serve_new_tokens: AtLeast1 = opt(256, "serve: tokens generated per request")
    serve_rounds: AtLeast1 = opt(2, "serve: requests each stream sends one after another")
    serve_client_procs: AtLeast1 = opt(8, "serve: load-generator processes")
    serve_max_prefill: tuple[AtLeast1, ...] = opt((16,), "serve: the server's --max_prefill (prompts of one length "
                                             "prefilled together); one row per value")
    serve_prefill_wait_ms: tuple[NonNegF, ...] = opt((150.0,), "serve: the server's --prefill_wait_ms (longest a "
                                                   "waiting request is held for more arrivals to share its prefill "
                                                   "forward); one row per value")
    serve_prefill_graphs: tuple[bool, ...] = opt((True,), "serve: the server's --prefill_graphs (prefill forwards "
                                                 "replayed from CUDA graphs) or not; one row per value")
    serve_prefill_graph_tokens: tuple[int, ...] = opt((2048,), "serve: the server's --prefill_graph_tokens (the "
                                                      "largest graphed prefill); one row per value")
    serve_attended_spans: tuple[bool, ...] = opt((True,), "serve: the server's --attended_spans (decode steps read "
                                                 "the filled prefix of the window rings) or not; one row per value")
    train_batch: int = opt(8, "training micro-batch (Table 50: 8 at 370M, 4 at 1.5B)")
    train_seq_len: int = opt(2048, "training context")
    train_warmup: int = opt(3, "untimed optimizer steps")
    train_steps: int = opt(10, "timed optimizer steps")
    train_peers: bool = opt(True, "also time the training step of the peers")
    compile: bool = opt(False, "torch.compile the ESSH model for prefill and train (elastic_ssm.compile_model; "
                        "compiled once per shape, the warm-up calls absorb the compile time; also the train loss)")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = opt(
        "default", "torch.compile mode with compile (reduce-overhead: CUDA graphs)")
    dtype: Literal["auto", "bfloat16", "float32"] = opt("auto", "weights / KV dtype: auto (bfloat16 on CUDA, "
                                                        "float32 on CPU), bfloat16, float32")
    device: str = opt("auto", "auto (cuda if available), cuda, cpu")
    peak_tflops: float = opt(989.0, "dense bf16 peak for MFU (H200 SXM datasheet: 989 TFLOP/s)")
    time_budget_s: NonNegF = opt(0.0, "skip the remaining entries after this many seconds (0: no limit; a suite: "
                               "its own budget_s unless this flag is given)")
    out: str = opt("bench_results.json", "JSON output path ('' to skip; a suite writes <out_dir>/<suite>.json and "
                   "also this file when the flag is given)")
    docs: str = opt("", "markdown file to append the tables (a suite: its section) to, e.g. docs/benchmarks.md "
                    "('' to skip)")
    seed: int = opt(0, "random seed of weights and tokens")


class _Runner:
    def __init__(self, cfg: BenchConfig, log: Callable[[str], None]) -> None:
        self.cfg, self.log, self.t0 = cfg, log, time.monotonic()
        from ..cli_util import resolve_device, resolve_dtype
        from ..elastic.tiers import tier_table

        self.dev = torch.device(resolve_device(cfg.device))
        self.dtype = resolve_dtype(cfg.dtype, str(self.dev))
        self.mcfg = ESSHConfig.preset(cfg.preset)

        self.table = {t.name: t for t in tier_table(self.mcfg)}
        self.full = list(self.table)[-1]
        names = list(self.table) if "all" in cfg.tiers else list(cfg.tiers)
        serve = [t for m in cfg.serve_mixes for t in m.split(",")]
        unknown = [n for n in names + list(cfg.prefill_tiers) + list(cfg.generate_tiers) + serve if n not in self.table]
        if unknown:
            raise ConfigError(f"BenchConfig.tiers: unknown {unknown}; {cfg.preset} has {list(self.table)}")
        self.tiers = names

    def essh(self, dtype: torch.dtype | None | str = "bench", compile: bool = True):
        """A random-weight ESSH of the preset, matrices in the bench dtype (or ``dtype``; None: float32), through
        ``compile_model`` when ``BenchConfig.compile`` (and ``compile``) is set."""
        from ..models import compile_model
        from .decode import random_model

        model = random_model(self.mcfg, self.dev, self.dtype if dtype == "bench" else dtype)
        if compile and self.cfg.compile:
            compile_model(model, mode=self.cfg.compile_mode)
        return model

    def run(self, section: list, base: dict, fn: Callable[[], dict]) -> None:
        """Append ``base | fn()`` to ``section``; errors and the time budget become the row's ``error``."""
        b = self.cfg.time_budget_s
        if b and time.monotonic() - self.t0 > b:
            row = {**base, "error": "skipped: time budget"}
        else:
            try:
                row = {**base, **fn()}
            except Exception as e:  # one failing entry must not abort the run
                from .decode import PeerUnavailable

                if not isinstance(e, PeerUnavailable):
                    traceback.print_exc()
                msg = str(e).splitlines()[0][:200] if str(e) else ""
                row = {**base, "error": f"{type(e).__name__}: {msg}"}
            finally:
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
        section.append(row)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k != "bench"}
        self.log(f"[{time.monotonic() - self.t0:6.1f}s] {row.get('bench', '')} {shown}")


def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None, print_tables: bool = True) -> dict:
    """Run the benchmarks of ``cfg``; returns (and writes as JSON to ``cfg.out``) ``{"env",
    "config", <section>: rows, "ratios"}``; a failing entry is its row's ``error``. ``log`` receives
    one line per completed entry (default: print, flushed); ``print_tables`` logs the tables at the end."""
    from .decode import decode_suite, generate_suite
    from .serve import serve_suite
    from .throughput import prefill_suite, train_suite

    log = log or (lambda s: print(s, flush=True))
    torch.manual_seed(cfg.seed)
    r = _Runner(cfg, log)
    results: dict = {"env": environment(r.dev), "config": cfg.to_dict(), **{name: [] for name in _BENCHES}}
    log(f"elastic-ssm bench on {results['env']['device']} ({r.dev}, {r.dtype}); preset {cfg.preset}")
    suites = {"decode": decode_suite, "prefill": prefill_suite, "generate": generate_suite, "train": train_suite,
              "serve": serve_suite}
    for name in _BENCHES:
        if name in cfg.benchmarks:
            suites[name](r, results[name])
    results["ratios"] = ratios(results)
    if print_tables:
        log("\n" + tables(results))
    if cfg.out:
        write_json(cfg.out, results)
        log(f"wrote {cfg.out}")
    if cfg.docs:
        append_markdown(cfg.docs, results)
        log(f"appended to {cfg.docs}")
    return results


# ---- output: environment record, text tables, ratios versus peers, JSON, docs/benchmarks.md sections ----
def ratios(results: dict) -> list[dict]:
    """Decode ms ratios ESSH/peer (same preset, tier = full, batch, mode) and prefill ktok/s ratios."""
    out = []
    for bench, keys, metric in (("decode", ("batch", "mode"), "ms"), ("prefill", ("length",), "ktok_s")):
        rows = [r for r in results.get(bench, []) if metric in r]
        essh = {(r["preset"], *map(r.get, keys)): r for r in rows if r["model"] == "essh" and r.get("full")}
        for r in rows:
            e = essh.get((r["preset"], *map(r.get, keys)))
            if r["model"] != "essh" and e is not None:
                batch, mode = (r["batch"], r["mode"]) if bench == "decode" else (1, f"T={r['length']}")
                out.append({"bench": bench, "preset": r["preset"], "peer": r["model"], "batch": batch, "mode": mode,
                            "essh": e[metric], "peer_value": r[metric], "ratio": e[metric] / r[metric]})
    return out


def write_json(path: str | Path, results: dict) -> Path:
    atomic_write_text(path, json.dumps(results, indent=1, default=str))
    return Path(path)


_DECODE_COLS = ["model", "preset", "tier", "params", "batch", "mode", "ms", "tok_s", "state_bytes_per_seq", "error"]
_PREFILL_COLS = ["model", "preset", "tier", "params", "compiled", "length", "ms", "ktok_s", "peak_gb", "error"]
_GENERATE_COLS = ["preset", "tier", "batch", "compiled", "prompt", "new_tokens", "first_call_s", "prefill_ms",
                  "prefill_ktok_s", "total_ms", "ms_per_token", "step_ms", "ratio", "graphed", "error"]
_TRAIN_COLS = ["model", "preset", "params", "compiled", "batch", "seq_len", "ms", "tok_s", "mfu", "peak_gb", "error"]
_SERVE_COLS = ["preset", "mix", "streams", "slots", "prompt", "new_tokens", "tokens", "wall_s", "tok_s",
               "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "prefills", "captures",
               "prefill_s", "idle_s", "http_cpu", "error"]
_RATIO_COLS = ["bench", "preset", "peer", "batch", "mode", "essh", "peer_value", "ratio"]


#: the result sections of one ``run_bench`` (in run order) and their columns
_SECTION_COLS = {"decode": _DECODE_COLS, "prefill": _PREFILL_COLS, "generate": _GENERATE_COLS, "train": _TRAIN_COLS,
                 "serve": _SERVE_COLS}
#: the columns of each section and of the ratios (a suite's tables of ``bench`` rows, ``benchmarks/suite_report.py``)
COLUMNS = {**_SECTION_COLS, "ratios": _RATIO_COLS}


def tables(results: dict) -> str:
    """All sections of ``results`` as text tables."""
    parts = [format_table(results[key], cols, title=f"## {key}")
             for key, cols in _SECTION_COLS.items() if results.get(key)]
    rat = ratios(results)
    if rat:
        parts.append(format_table(rat, _RATIO_COLS, title="## ratios (decode: ESSH ms / peer ms; "
                                                          "prefill: ESSH ktok/s / peer ktok/s)"))
    return "\n\n".join(parts)


def markdown_section(results: dict, what: str = "", body: str | None = None) -> str:
    """One run (``what``: e.g. "suite `h200` on ") as a markdown section: its date and device, versions, commit and
    command, then ``body`` (default: all its tables) in a code block."""
    env = results.get("env", {})
    return (f"\n## {env.get('date', '?')}: {what}{env.get('device', '?')}\n\n"
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton')}, fla {env.get('fla')}, "
            f"commit `{env.get('commit')}`; command: `{env.get('command')}`\n\n```\n"
            + (tables(results) if body is None else body) + "\n```\n")


def append_markdown(path: str | Path, results: dict, section: str | None = None) -> Path:
    """Append one run (``section``, default ``markdown_section(results)``) to a markdown file
    (``docs/benchmarks.md``), creating it with a header; what is there already is never rewritten."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmarks\n\nRaw numbers appended by `elastic-ssm bench` (one section per run; "
                        "see docs/performance.md for the protocol).\n")
    with path.open("a") as f:
        f.write(markdown_section(results) if section is None else section)
    return path


def bench_command(given: dict) -> dict:
    """``elastic-ssm bench`` with the ``BenchConfig`` fields the user gave (``given``): a suite when ``suite``
    is set (``benchmarks/suite.py`` of a clone, ``suite_command``; the other given fields override entry options),
    else one ``run_bench``."""
    from ..cli_util import resolve_device
    from ..utils.files import check_output_path

    cfg = BenchConfig(**given)
    # what would otherwise fail after the measurements (or be ignored): suite-only flags without a suite, a device
    # this machine lacks, output files that cannot be written (a suite's --bench.out_dir: suite_command)
    for key in ("set", "only"):
        if given.get(key) and not cfg.suite:
            raise ConfigError(f"--bench.{key} picks or changes entries of a suite; give --bench.suite NAME as well")
    if cfg.device != "auto" and not cfg.suite:     # a suite's entries may name their own devices
        resolve_device(cfg.device, "--bench.device")
    if not ({"suite", "device", "preset"} & given.keys() or torch.cuda.is_available()):   # 370m: hours on a CPU
        raise ConfigError("no CUDA GPU here, and the benchmarks time the 370m preset against its peers (hours on a "
                          "CPU); run --bench.suite cpu-smoke (seconds), or pass --bench.device cpu to time them here")
    for key in ("out", "docs"):
        if getattr(cfg, key) and (key in given or not cfg.suite):
            check_output_path(f"--bench.{key}", getattr(cfg, key), "file")
    if not cfg.suite:
        return run_bench(cfg)
    try:
        suites = harness_module("--bench.suite", "benchmarks.suite")
    except ConfigError:
        raise ConfigError("--bench.suite: bench suites run from a clone of the repository (the research harness in "
                          "its benchmarks/ folder and the suites in configs/bench/ are not installed with "
                          "elastic_ssm); run elastic-ssm bench --bench.suite from the root of a clone") from None
    return suites.suite_command(cfg, given)


#: the research harness: a top-level package of the repository beside ``elastic_ssm/``, not installed
HARNESS = "benchmarks"
#: the folder this ``elastic_ssm`` is imported from: the clone's root for a checkout or an editable install
CHECKOUT = Path(__file__).resolve().parents[2]


def harness_roots() -> list[Path]:
    """Folders that may hold the harness (``benchmarks/__init__.py``): the current folder, then the checkout this
    ``elastic_ssm`` is imported from (an editable install run from elsewhere)."""
    dirs = [Path.cwd(), CHECKOUT]
    return [d for d in dict.fromkeys(dirs) if (d / HARNESS / "__init__.py").is_file()]


def harness_module(what: str, module: str):
    """``module``; a harness module is looked up in ``harness_roots()`` when it is not importable (the installed
    ``elastic-ssm`` run outside the repository root), else a one-line ``ConfigError`` naming ``what`` needs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if module.partition(".")[0] != HARNESS or not (e.name or "").partition(".")[0] == HARNESS:
            raise
    for root in harness_roots():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        if getattr(sys.modules.get(HARNESS), "__file__", 1) is None:    # a namespace package: some folder named
            for name in [m for m in sys.modules if m.partition(".")[0] == HARNESS]:   # benchmarks/ on sys.path
                del sys.modules[name]
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not (e.name or "").partition(".")[0] == HARNESS:
                raise
    raise ConfigError(f"{what} belongs to the research harness in the repository's {HARNESS}/ folder "
                      f"(not installed with elastic_ssm): run it from the root of a clone ({module} not found)")
