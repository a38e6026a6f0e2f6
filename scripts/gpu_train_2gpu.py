"""Two-GPU training check (issue #19): every recipe x parallel x scan x precision finishes, then the scaling.

Run on a machine with 2 GPUs (it starts its own ``torchrun --nproc_per_node 2`` subprocesses)::

    python scripts/gpu_train_2gpu.py                          # both stages, ~8 minutes on 2 x H200
    python scripts/gpu_train_2gpu.py --stages combos          # one stage per 10-minute device call
    python scripts/gpu_train_2gpu.py --stages scaling --compile

Stage ``combos``: the README's ``torchrun --nproc_per_node 2 -m elastic_ssm.cli train --config RUN.yaml`` with
the issue's RUN.yaml (ESSH preset small, seq_len 256, micro_batch 8, grad_accum 2, the stdlib byte corpus) for
each recipe (dense, capacity_mixed) x parallel (ddp, fsdp) x scan (torch, fla: ``ELASTIC_SSM_SCAN_BACKEND``) x
precision (fp32, bf16), ``--steps`` steps each, every run a subprocess with a timeout. Capacity-mixed runs mix
from step 1 with capacities {1/4, 1}, so about half the steps put one rank's micro-batch at full capacity and
the other's at 1/4 (``split``: the FSDP2 case that used to hang). One line per run as it finishes.

Stage ``scaling``: the 370m preset at seq_len 2048 (micro-batch 8, its own vocabulary) on 1 GPU with
``2 x M`` micro-batches per step and on 2 GPUs (DDP, FSDP2) with ``M`` each: the same global batch, so the
three loss curves overlay (``train_curves.json``, ``train_curves.png`` when matplotlib is installed) and
tokens/s compare directly (median over steps after the first ``--skip`` steps). Everything lands in ``$OUT``
(or ``--out``): ``gpu_train_2gpu.json`` with every result, and ``logs/<run>.log`` with each run's output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout without `pip install -e .` (the GPU machine) imports elastic_ssm from here
RUN_YAML = """model:
  arch: essh
  preset: {preset}
train:
  recipe: dense
  micro_batch_size: {micro}
  grad_accum: {accum}
  seq_len: {seq_len}
  n_warm_tokens: 0
  full_share: 0.5
  capacities: [0.25, 1.0]
  eval_every: 0
  eval_batches: 2
  checkpoint_every: 0
  log_every: 1
data:
  source: stdlib
  tokenizer: bytes
"""


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="combos,scaling", help="comma-separated: combos, scaling")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps of each combination run")
    p.add_argument("--timeout-s", type=float, default=150.0, help="limit of one combination run (fla compiles)")
    p.add_argument("--scaling-steps", type=int, default=12)
    p.add_argument("--scaling-accum", type=int, default=2, help="M: micro-batches per step on each of 2 GPUs")
    p.add_argument("--scaling-recipe", default="dense", help="recipe of the scaling runs")
    p.add_argument("--scaling-timeout-s", type=float, default=240.0)
    p.add_argument("--skip", type=int, default=3, help="first steps left out of tokens/s (compile, autotune)")
    p.add_argument("--compile", action="store_true", help="scaling runs with --train.compile (blocks)")
    p.add_argument("--budget-s", type=float, default=480.0, help="runs that would start later are skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_train_2gpu_out"))
    return p.parse_args(argv)


class Runner:
    """Runs ``elastic-ssm train`` subprocesses and reads their ``metrics.jsonl``."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.out, self.t0 = a, Path(a.out), time.monotonic()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.results: list[dict] = []

    def config(self, name: str, preset: str, micro: int, accum: int, seq_len: int) -> Path:
        path = self.out / "runs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RUN_YAML.format(preset=preset, micro=micro, accum=accum, seq_len=seq_len))
        return path

    def run(self, name: str, nproc: int, cfg: Path, flags: list[str], env: dict, timeout: float) -> dict:
        out_dir = self.out / "runs" / name
        rec = {"name": name, "nproc": nproc, "flags": flags, "env": env}
        if time.monotonic() - self.t0 > self.a.budget_s:
            rec.update(rc=None, note="skipped: --budget-s spent")
            return self._done(rec)
        launcher = ["torchrun", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
        cmd = [*launcher, "-m", "elastic_ssm.cli", "train", "--config", str(cfg), "--train.out_dir", str(out_dir),
               "--overwrite", *flags]
        t = time.monotonic()
        try:
            path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
            proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": path, **env}, capture_output=True,
                                  text=True, timeout=timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            parts = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x]
            rc, text = "timeout", "".join(parts)
        (self.out / "logs" / f"{name}.log").write_text(" ".join(cmd) + "\n" + text)
        rec.update(rc=rc, wall_s=round(time.monotonic() - t, 1), **self._metrics(out_dir))
        if rc != 0:
            rec["last_line"] = next((x for x in reversed(text.strip().splitlines()) if x.strip()), "")[-300:]
        return self._done(rec)

    def _metrics(self, out_dir: Path) -> dict:
        path = out_dir / "metrics.jsonl"
        recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        train = [r for r in recs if r.get("kind") == "train"]
        speeds = [r["tokens_per_s"] for r in train[self.a.skip:]] or [r["tokens_per_s"] for r in train]
        split = sum(1 for r in train if len(r["capacities"]) >= 4 and any(
            (c[0] == 1.0) != (c[1] == 1.0) for c in zip(r["capacities"][0::2], r["capacities"][1::2])))
        return {"steps": len(train), "tok_s": round(statistics.median(speeds)) if speeds else None,
                "loss": [r["loss"] for r in train], "split_steps": split}

    def _done(self, rec: dict) -> dict:
        self.results.append(rec)
        shown = {k: rec.get(k) for k in ("rc", "steps", "tok_s", "split_steps", "wall_s", "note", "last_line")
                 if rec.get(k) is not None}
        print(f"{rec['name']:<40} " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
        self.save()
        return rec

    def save(self) -> None:
        import torch

        env = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in
                                                    range(torch.cuda.device_count())]}
        (self.out / "gpu_train_2gpu.json").write_text(json.dumps({"env": env, "results": self.results}, indent=1))


def combos(r: Runner) -> None:
    from elastic_ssm.ops.dispatch import fla_available

    a = r.a
    cfg = r.config("combo", "small", 8, 2, 256)
    for recipe in ("dense", "capacity_mixed"):
        for parallel in ("ddp", "fsdp"):
            for scan in ("torch", "fla"):
                for precision in ("fp32", "bf16"):
                    name = f"{recipe}-{parallel}-{scan}-{precision}"
                    if scan == "fla" and not fla_available():
                        r._done({"name": name, "note": "not run: fla (fla-core) does not import here"})
                        continue
                    flags = ["--train.recipe", recipe, "--train.parallel", parallel, "--train.precision",
                             precision, "--train.steps", str(a.steps), "--train.dist_timeout_s", "120"]
                    r.run(name, 2, cfg, flags, {"ELASTIC_SSM_SCAN_BACKEND": scan}, a.timeout_s)


def scaling(r: Runner) -> None:
    import elastic_ssm as es

    a = r.a
    vocab = es.ESSHConfig.preset("370m").vocab_size
    common = ["--train.recipe", a.scaling_recipe, "--train.precision", "bf16", "--train.steps", str(a.scaling_steps),
              "--model.vocab_size", str(vocab), "--data.max_train_bytes", "40000000"]
    if a.compile:
        common += ["--train.compile"]
    one = r.run("370m-1gpu", 1, r.config("s1", "370m", 8, 2 * a.scaling_accum, 2048), common, {},
                a.scaling_timeout_s)
    cfg2 = r.config("s2", "370m", 8, a.scaling_accum, 2048)
    ddp = r.run("370m-2gpu-ddp", 2, cfg2, [*common, "--train.parallel", "ddp"], {}, a.scaling_timeout_s)
    fsdp = r.run("370m-2gpu-fsdp", 2, cfg2, [*common, "--train.parallel", "fsdp"], {}, a.scaling_timeout_s)
    for run in (ddp, fsdp):
        if one.get("tok_s") and run.get("tok_s"):
            print(f"scaling {run['name']}: {run['tok_s'] / one['tok_s']:.2f}x the 1-GPU tokens/s "
                  f"({run['tok_s']:,} vs {one['tok_s']:,}; target for DDP >= 1.8x)", flush=True)
    curves = {x["name"]: x.get("loss", []) for x in (one, ddp, fsdp)}
    (r.out / "train_curves.json").write_text(json.dumps(curves, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: wrote train_curves.json only", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, loss in curves.items():
        ax.plot(range(1, len(loss) + 1), loss, label=name, marker=".")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="370m, L=2048, same global batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(r.out / "train_curves.png", dpi=120)
    print(f"wrote {r.out / 'train_curves.png'}", flush=True)


def main(argv=None) -> None:
    a = _args(argv)
    r = Runner(a)
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = set(stages) - {"combos", "scaling"}
    if unknown:
        raise SystemExit(f"--stages: unknown stage(s) {sorted(unknown)}; use combos and/or scaling")
    for stage in stages:
        print(f"== {stage} ==", flush=True)
        {"combos": combos, "scaling": scaling}[stage](r)
    print(f"wrote {r.out / 'gpu_train_2gpu.json'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
