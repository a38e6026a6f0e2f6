"""Fault-injection harness: a tiny training run as a subprocess, killed where the test says.

Run as a script, it is ``elastic-ssm train`` with one fault armed (``--fault KIND:ARG``) before
``elastic_ssm.cli.main`` starts:

* ``sigkill-step:N``  SIGKILL right after training step N is logged (before its checkpoint is written);
* ``sigterm-step:N``  SIGTERM to itself at step N: the run must finish the step, checkpoint and exit 143;
* ``sigkill-write:NAME``  SIGKILL inside the first atomic write of a file called NAME, after half of its
  bytes reached the temporary file (a torn checkpoint directory and a stale temporary file stay behind);
* ``sigkill-prune:1``  SIGKILL while the first old checkpoint is being deleted (half of it is gone);
* ``fill-disk:N``  after training step N is logged, fill the file system of the run directory (a file
  ``<out_dir>/../filler``), so the next write finds no space left (a full disk in the middle of a run);
* ``sigterm-write:PATH``  SIGTERM to itself inside the first atomic write of a file whose path ends in PATH (e.g.
  ``final/model.safetensors``: a cluster's preemption during the final save), before its bytes are written.

As a module it gives the tests the run file, the corpus and ``start`` / ``run`` helpers.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

RUN_YAML = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: STEPS, micro_batch_size: 2, grad_accum: 2, seq_len: 32, log_every: 1,
        device: cpu, mixing: {n_warm_tokens: 64}, ordering: {every: 2}, eval: {every: 0, batches: 1, tiers: [T1, T10]},
        checkpoint: {every: 1, keep_last: 2}}
data: {source: CORPUS, tokenizer: bytes}
"""


def write_run(root: Path, steps: int = 7) -> Path:
    """A corpus (deterministic pseudo-text, ~40 kB) and a run YAML under ``root``; returns the YAML path."""
    rng = random.Random(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "x", "y"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(4000)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    cfg = root / "run.yaml"
    cfg.write_text(RUN_YAML.replace("STEPS", str(steps)).replace("CORPUS", str(corpus)))
    return cfg


def trained_run(root: Path, steps: int, *extra: str) -> tuple[Path, Path]:
    """A run file under ``root`` trained in process into ``root/run`` (``extra``: more CLI flags, e.g.
    ``--stop_after 3``), warnings silenced; returns ``(run file, run directory)``."""
    import warnings

    from elastic_ssm.cli import main

    cfg = write_run(root, steps=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(root / "run"), *extra]) == 0
    return cfg, root / "run"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def start(cfg: Path, out: Path, *extra: str, fault: str | None = None) -> subprocess.Popen:
    """Start the harness on run file ``cfg`` into ``out`` (stdout and stderr captured as text)."""
    argv = [sys.executable, str(Path(__file__)), *(["--fault", fault] if fault else []), "train", "--config",
            str(cfg), "--train.out_dir", str(out), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=str(out.parent))


def run(cfg: Path, out: Path, *extra: str, fault: str | None = None, timeout: float = 120):
    """Run the harness to its end; returns ``(returncode, stdout, stderr)``."""
    p = start(cfg, out, *extra, fault=fault)
    stdout, stderr = p.communicate(timeout=timeout)
    return p.returncode, stdout, stderr


def _arm(fault: str) -> None:
    """Patch the library so that the process dies (or is signalled) at the requested point."""
    import shutil

    import elastic_ssm.models.base as base
    import elastic_ssm.train.checkpoint as ckpt
    from elastic_ssm.train.metrics import MetricsLogger

    kind, arg = fault.split(":", 1)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if kind == "fill-disk":
        original_step = MetricsLogger.train_step

        def train_step(self, record, log):
            original_step(self, record, log)
            if record["step"] == int(arg):
                with open(self.path.parent.parent / "filler", "wb", buffering=0) as f:
                    for size in (1 << 16, 1 << 12, 1):       # to the last byte
                        try:
                            while True:
                                f.write(b"\0" * size)
                        except OSError:
                            pass

        MetricsLogger.train_step = train_step
    elif kind in ("sigkill-step", "sigterm-step"):
        original_step = MetricsLogger.train_step

        def train_step(self, record, log):
            original_step(self, record, log)
            if record["step"] == int(arg):
                os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill-step" else signal.SIGTERM)

        MetricsLogger.train_step = train_step
    elif kind == "sigkill-write":
        original_write = base.atomic_write_bytes

        def atomic_write_bytes(path, data):
            if Path(path).name == arg:
                torn = Path(path).parent / f".{Path(path).name}.torn.tmp"
                torn.write_bytes(data[: len(data) // 2])
                die()
            return original_write(path, data)

        base.atomic_write_bytes = ckpt.atomic_write_bytes = atomic_write_bytes
    elif kind == "sigterm-write":
        original_write = base.atomic_write_bytes
        sent = []

        def atomic_write_bytes(path, data):    # save_pretrained writes into a staging folder inside its target
            logical = "/".join(q for q in Path(path).parts if not (q.startswith(".save.") and q.endswith(".tmp")))
            if not sent and logical.endswith(arg):
                sent.append(path)
                os.kill(os.getpid(), signal.SIGTERM)
            return original_write(path, data)

        base.atomic_write_bytes = ckpt.atomic_write_bytes = atomic_write_bytes
    elif kind == "sigkill-prune":
        original_rmtree = shutil.rmtree

        def rmtree(path, *a, **kw):
            victim = Path(path)
            if victim.name.startswith("step_") and (victim / "model").is_dir():
                original_rmtree(victim / "model")
                die()
            return original_rmtree(path, *a, **kw)

        ckpt.shutil.rmtree = rmtree
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    args = sys.argv[1:]
    if args[:1] == ["--fault"]:
        _arm(args[1])
        args = args[2:]
    from elastic_ssm.cli import main

    sys.exit(main(args))
