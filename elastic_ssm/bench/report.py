"""Benchmark output: environment record, plain-text tables, ratios versus peers (decode ms ESSH / peer, prefill
ktok/s ESSH / peer), JSON, and sections appended to ``docs/benchmarks.md``."""

from __future__ import annotations

import json
from pathlib import Path

from ..utils.environment import environment
from ..utils.files import atomic_write_text
from ..utils.progress import format_table

__all__ = ["COLUMNS", "environment", "format_table", "ratios", "tables", "write_json",
           "markdown_section", "append_markdown"]


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
