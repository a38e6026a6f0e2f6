"""Loggers beside ``metrics.jsonl`` that ``train.log`` names, given the scalars of the same records on rank 0
(docs/training.md, "Metrics and validation"): ``csv`` (``<out_dir>/metrics.csv``, long format; a resumed stage drops
the rows after its checkpoint), ``tensorboard`` (``<out_dir>/tensorboard/``) and ``wandb`` (extra ``log``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from ..config.train import LOG_SINKS as SINKS
from ..utils.files import atomic_write_bytes

__all__ = ["SINKS", "make_sinks", "scalars"]
_SKIP = {"kind", "stage", "step", "tier"}
CSV_FIELDS = ("kind", "stage", "step", "tier", "metric", "value")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a record, without its keys (kind, stage, step, tier)."""
    return {k: float(v) for k, v in record.items() if k not in _SKIP and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def keep_lines(path: Path, text: str, keep) -> None:
    """Rewrite ``path`` (atomically) with the lines of its ``text`` that ``keep`` (untouched when all are kept)."""
    lines = text.splitlines()
    kept = [line for line in lines if keep(line)]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(f"{x}\n" for x in kept).encode())


def _tag(record: dict[str, Any], metric: str) -> str:
    stage = record.get("stage", "train")
    return f"{stage}/eval/{record['tier']}/{metric}" if record.get("kind") == "eval" else f"{stage}/{metric}"


class CsvSink:
    def __init__(self, out_dir: Path, run: dict[str, Any]) -> None:
        self.path = out_dir / "metrics.csv"
        if not self.path.is_file():
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(CSV_FIELDS)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as f:
            w = csv.writer(f)
            for metric, value in scalars(record).items():
                w.writerow([record.get("kind", ""), record.get("stage", ""), record.get("step", ""),
                            record.get("tier", ""), metric, repr(value)])

    def drop_after(self, stage: str, step: int) -> None:
        def keep(line: str) -> bool:
            r = line.split(",")
            return r == list(CSV_FIELDS) or len(r) == len(CSV_FIELDS) and not (
                r[1] == stage and r[2].isdigit() and int(r[2]) > step)
        keep_lines(self.path, self.path.read_text(), keep)

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, out_dir: Path, run: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        for metric, value in scalars(record).items():
            self.writer.add_scalar(_tag(record, metric), value, int(record.get("step", 0)))

    def drop_after(self, stage: str, step: int) -> None:
        pass                   # TensorBoard shows the latest value of a tag and step

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, out_dir: Path, run: dict[str, Any]) -> None:
        import os

        import wandb

        (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "elastic_ssm"), name=out_dir.name,
                              dir=str(out_dir), config=run, resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        values = {_tag(record, m): v for m, v in scalars(record).items()}
        values[f"{record.get('stage', 'train')}/step"] = int(record.get("step", 0))
        self.run.log(values)

    def drop_after(self, stage: str, step: int) -> None:
        pass                   # W&B keeps its history; metrics.jsonl is the record of truth

    def close(self) -> None:
        self.run.finish()


_CLASSES = {"csv": CsvSink, "tensorboard": TensorBoardSink, "wandb": WandbSink}
assert set(_CLASSES) == set(SINKS)


def make_sinks(names, out_dir: str | Path, run: dict[str, Any]) -> list:
    """The sinks ``names`` (``train.log``) writing into ``out_dir``; a missing optional package is a one-line
    ``ImportError`` naming the extra."""
    sinks = []
    for name in names:
        try:
            sinks.append(_CLASSES[name](Path(out_dir), run))
        except ModuleNotFoundError as e:
            raise ImportError(f"train.log {name!r} needs the {name} package ({e.name} is not "
                              "installed): pip install 'elastic-ssm[log]'") from None
    return sinks
