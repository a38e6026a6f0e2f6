"""Multi-GPU training through ``elastic-ssm train`` under torchrun (issue 19): suite kinds ``train_matrix``
(every recipe x parallel x scan backend x precision finishes) and ``train_scaling`` (1 GPU vs N GPUs at the
same global batch: tokens/s and loss curves).

Each run is a child process, ``python -m torch.distributed.run --standalone --nproc_per_node N -m
elastic_ssm.cli train --config RUN.yaml --train.out_dir D --overwrite FLAGS`` (``python -m elastic_ssm.cli
train`` on one GPU), with a timeout; the run file is the entry's ``run`` mapping (written to
``runs/<name>.yaml`` in the entry folder), the matrix axes become ``--train.*`` flags and
``ELASTIC_SSM_SCAN_BACKEND``. A row per run reads the run's ``metrics.jsonl``: optimizer steps, median
tokens/s after the first ``skip`` steps, the loss curve, and ``split_steps`` (steps where one rank's first
micro-batch ran at full capacity and the other's did not: the FSDP2 case that used to hang). Output of each
run: ``logs/<name>.log``. Runs that would start after the suite's budget are rows marked skipped.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from elastic_ssm.config import ConfigBase, ConfigError, opt

__all__ = ["TrainMatrixOptions", "TrainScalingOptions", "run_matrix", "run_scaling", "train_run"]


def _run_field(help_: str) -> Any:
    return field(default_factory=dict, metadata={"help": help_})


@dataclass(kw_only=True)
class TrainMatrixOptions(ConfigBase):
    """``elastic-ssm train`` under torchrun for every combination of the axes."""

    run: dict[str, Any] = _run_field("the run file (model / train / data sections) every combination trains")
    recipes: tuple[str, ...] = opt(("dense", "capacity_mixed"), "--train.recipe values")
    parallels: tuple[str, ...] = opt(("ddp", "fsdp"), "--train.parallel values")
    scans: tuple[str, ...] = opt(("torch", "fla"), "ELASTIC_SSM_SCAN_BACKEND values (fla runs only where it imports)")
    precisions: tuple[str, ...] = opt(("fp32", "bf16"), "--train.precision values")
    nproc: int = opt(2, "processes (GPUs) per run")
    steps: int = opt(8, "optimizer steps of each run (--train.steps)")
    flags: tuple[str, ...] = opt(("--train.dist_timeout_s", "120"), "further flags of every run")
    timeout_s: float = opt(150.0, "limit of one run (fla compiles on first use)")
    skip: int = opt(3, "first steps left out of tokens/s (compile, autotune)")

    def validate(self) -> None:
        if not isinstance(self.run, dict) or not self.run or self.nproc < 1 or self.steps < 1:
            raise ConfigError("TrainMatrixOptions: give the run file as 'run:' (model/train/data sections); "
                              "nproc and steps must be >= 1")


@dataclass(kw_only=True)
class TrainScalingOptions(ConfigBase):
    """One run on 1 GPU with ``nproc x accum`` micro-batches per step, then ``nproc`` GPUs with ``accum`` each."""

    run: dict[str, Any] = _run_field("the run file; its train.grad_accum is set per run")
    nproc: int = opt(2, "GPUs of the data-parallel runs")
    accum: int = opt(2, "micro-batches per step on each of the nproc GPUs (the 1-GPU run takes nproc x accum)")
    parallels: tuple[str, ...] = opt(("ddp", "fsdp"), "--train.parallel of the multi-GPU runs")
    steps: int = opt(12, "optimizer steps of each run")
    flags: tuple[str, ...] = opt((), "further flags of every run, e.g. [--train.compile]")
    vocab_of_preset: bool = opt(True, "train with the model preset's own vocabulary (--model.vocab_size), not "
                                      "the data's byte vocabulary")
    timeout_s: float = opt(240.0, "limit of one run")
    skip: int = opt(3, "first steps left out of tokens/s")

    def validate(self) -> None:
        if not isinstance(self.run, dict) or not self.run or self.nproc < 2 or self.accum < 1 or self.steps < 1:
            raise ConfigError("TrainScalingOptions: give the run file as 'run:'; nproc must be >= 2, accum and "
                              "steps >= 1")


def _metrics(out_dir, skip: int) -> dict:
    path = out_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    train = [r for r in recs if r.get("kind") == "train"]
    speeds = [r["tokens_per_s"] for r in train[skip:]] or [r["tokens_per_s"] for r in train]
    split = sum(1 for r in train if len(r.get("capacities", [])) >= 4 and any(
        (c[0] == 1.0) != (c[1] == 1.0) for c in zip(r["capacities"][0::2], r["capacities"][1::2])))
    return {"steps": len(train), "tok_s": round(statistics.median(speeds)) if speeds else None,
            "loss": [r["loss"] for r in train], "split_steps": split}


def train_run(ctx, name: str, run: dict, nproc: int, flags: list[str], env: dict[str, str], timeout: float,
              skip: int) -> dict:
    """One ``elastic-ssm train`` child (torchrun when ``nproc > 1``); its row (see the module docstring)."""
    rec: dict = {"name": name, "nproc": nproc}
    if ctx.time_left() <= 0:
        return {**rec, "error": "skipped: time budget"}
    cfg = ctx.path(f"runs/{name}.yaml")
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump(run, sort_keys=False))
    out_dir = ctx.out_dir / "runs" / name
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "elastic_ssm.cli", "train", "--config", str(cfg), "--train.out_dir", str(out_dir),
           "--overwrite", *flags]
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, env=ctx.child_env(env), capture_output=True, text=True,
                           timeout=max(1.0, min(timeout, ctx.time_left())))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x]
        rc, text = "timeout", "".join(parts)
    log = ctx.path(f"logs/{name}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(" ".join(cmd) + "\n" + text)
    rec.update(rc=rc, wall_s=round(time.monotonic() - t, 1), **_metrics(out_dir, skip))
    if rc != 0:
        rec["error"] = next((x for x in reversed(text.strip().splitlines()) if x.strip()), "")[-300:]
    shown = {k: rec[k] for k in ("rc", "steps", "tok_s", "split_steps", "wall_s", "error") if rec.get(k) is not None}
    ctx.log(f"  {name:<40} " + " ".join(f"{k}={v}" for k, v in shown.items()))
    return rec


def run_matrix(opts: TrainMatrixOptions, ctx) -> list[dict]:
    """Rows ``{"name", "recipe", "parallel", "scan", "precision", "rc", "steps", "tok_s", "split_steps", ...}``."""
    from elastic_ssm.ops.dispatch import fla_available

    rows = []
    for recipe in opts.recipes:
        for parallel in opts.parallels:
            for scan in opts.scans:
                for precision in opts.precisions:
                    name = f"{recipe}-{parallel}-{scan}-{precision}"
                    axes = {"recipe": recipe, "parallel": parallel, "scan": scan, "precision": precision}
                    if scan == "fla" and not fla_available():
                        rows.append({"name": name, **axes, "error": "not run: fla (fla-core) does not import here"})
                        continue
                    flags = ["--train.recipe", recipe, "--train.parallel", parallel, "--train.precision", precision,
                             "--train.steps", str(opts.steps), *opts.flags]
                    rows.append({**axes, **train_run(ctx, name, opts.run, opts.nproc, flags,
                                                     {"ELASTIC_SSM_SCAN_BACKEND": scan}, opts.timeout_s, opts.skip)})
    return rows


def _with_accum(run: dict, accum: int) -> dict:
    return {**run, "train": {**(run.get("train") or {}), "grad_accum": accum}}


def run_scaling(opts: TrainScalingOptions, ctx) -> list[dict]:
    """Rows per run (``tok_s``, ``loss``) and ``speedup`` = N-GPU tokens/s / 1-GPU tokens/s; writes
    ``train_curves.json`` and, with matplotlib, ``train_curves.png`` (the loss curves overlay: same global
    batch)."""
    flags = ["--train.steps", str(opts.steps), *opts.flags]
    if opts.vocab_of_preset:
        from elastic_ssm.config import model_configs

        model = opts.run.get("model") or {}
        mcfg = model_configs()[model.get("arch", "essh")].preset(model.get("preset", "370m"))
        flags += ["--model.vocab_size", str(mcfg.vocab_size)]
    one = train_run(ctx, "1gpu", _with_accum(opts.run, opts.nproc * opts.accum), 1, flags, {}, opts.timeout_s,
                    opts.skip)
    rows = [{"parallel": "-", **one}]
    for parallel in opts.parallels:
        r = train_run(ctx, f"{opts.nproc}gpu-{parallel}", _with_accum(opts.run, opts.accum), opts.nproc,
                      [*flags, "--train.parallel", parallel], {}, opts.timeout_s, opts.skip)
        if one.get("tok_s") and r.get("tok_s"):
            r["speedup"] = r["tok_s"] / one["tok_s"]
        rows.append({"parallel": parallel, **r})
    curves = {r["name"]: r.get("loss", []) for r in rows}
    ctx.save_json("train_curves.json", curves)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ctx.log("  matplotlib is not installed: wrote train_curves.json only")
        return rows
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, loss in curves.items():
        ax.plot(range(1, len(loss) + 1), loss, label=name, marker=".")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="same global batch on 1 and N GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ctx.path("train_curves.png"), dpi=120)
    plt.close(fig)
    return rows
