"""A serving burst's prefill, timed and profiled on CUDA: ``SlotPool.admit_many`` of ``--rows`` prompts of
``--prompt`` random tokens into a pool of random-weight ``--preset`` (bf16), as the server's engine admits them
(one eager forward when rows x prompt exceed the prefill-graph limit), and the same prompts as graphed prefills of
``--chunk`` rows. One JSON line per measurement: ``{"pool", "path", "ms": [per repeat], "captures"}``. With
``--out DIR`` each pool's eager prefill is also run once under torch.profiler: ``DIR/prefill_<tiers>.txt``, the
ops by CUDA time and by self CPU time (docs/benchmarks.md, "Serve").

    python -m benchmarks.serve_prefill --out /tmp/prefill          # the serve suite's ``prefill-burst`` entry
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_ssm.config import opt


@dataclass(kw_only=True)
class PrefillProbeOptions:
    """The burst and the pools."""

    preset: str = opt("1.5b", "ESSH preset of the random-weight model")
    device: str = opt("cuda", "where the model runs (cpu: the harness's own test, no CUDA timing)")
    pools: tuple[str, ...] = opt(("T10", "T1,T4,T10"), "the tiers of each pool (a mixed pool's rows cycle "
                                                        "through them)")
    rows: int = opt(128, "prompts admitted together (the pool has as many slots)")
    prompt: int = opt(128, "tokens per prompt")
    repeats: int = opt(6, "timed admissions per path")
    chunk: int = opt(16, "rows per graphed prefill (0: no graphed path)")
    out: str = opt("", "folder for the torch.profiler tables ('': none)")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _admit(pool, owners: list, prompts: list, tiers: list, chunk: int) -> list[int]:
    """``prompts`` admitted ``chunk`` at a time (0: all together); the rows they took."""
    c = chunk or len(prompts)
    return [r for s in range(0, len(prompts), c)
            for r in pool.admit_many(owners[s:s + c], prompts[s:s + c], tiers[s:s + c])]


def _timed(pool, args: tuple, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` admissions ``_admit(pool, *args)``, synchronized; rows freed after each."""
    ms = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        rows = _admit(pool, *args)
        _sync()
        ms.append(round((time.perf_counter() - start) * 1e3, 1))
        for r in rows:
            pool.release(r)
    return ms


def _profile(pool, owners, prompts, tiers, path: Path) -> None:
    from benchmarks.profiling import torch_profiled

    tables: list[str] = []
    with torch_profiled(f"eager prefill, {pool.slots} slots", tables):
        rows = pool.admit_many(owners, prompts, tiers)
        _sync()
    for r in rows:
        pool.release(r)
    path.write_text(tables[0])


def run(a: PrefillProbeOptions) -> list[dict]:
    from elastic_ssm.bench.decode import random_model
    from elastic_ssm.config import ESSHConfig
    from elastic_ssm.serve.slots import SlotPool

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("serve_prefill: no CUDA device here; pass --device cpu for the harness's own check")
    torch.manual_seed(0)
    model = random_model(ESSHConfig.preset(a.preset), device, torch.bfloat16 if device.type == "cuda" else None).eval()
    prompts = torch.randint(0, model.config.vocab_size, (a.rows, a.prompt)).tolist()
    owners, out = list(range(a.rows)), []
    for spec in a.pools:
        names = spec.split(",")
        tiers = [names[i % len(names)] for i in range(a.rows)]
        pool = SlotPool(model, names, a.rows, max_prefill=a.rows, prefill_graphs=False)
        out.append({"pool": spec, "path": f"eager {a.rows} x {a.prompt}",
                     "ms": _timed(pool, (owners, prompts, tiers, 0), a.repeats)})
        print(json.dumps(out[-1]), flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            _profile(pool, owners, prompts, tiers, Path(a.out) / f"prefill_{spec.replace(',', '_')}.txt")
        del pool
        if a.chunk:                              # the first repeat captures the graph
            pool = SlotPool(model, names, a.rows, max_prefill=a.chunk, prefill_graphs=True, graph_after=1)
            out.append({"pool": spec, "path": f"graphed {-(-a.rows // a.chunk)} x ({a.chunk} x {a.prompt})",
                        "ms": _timed(pool, (owners, prompts, tiers, a.chunk), a.repeats), "captures": pool.captures})
            print(json.dumps(out[-1]), flush=True)
            del pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    from elastic_ssm.cli_util import derive

    run(derive(PrefillProbeOptions, argv, "python -m benchmarks.serve_prefill", __doc__.splitlines()[0]))


if __name__ == "__main__":
    main()
