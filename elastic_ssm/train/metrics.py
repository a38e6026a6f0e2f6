"""Training metrics (docs/training.md, "Metrics and validation" lists the fields): ``metrics.jsonl`` (rank 0, the
record of truth; ``kind`` ``train`` or ``eval``), a tqdm bar and per-tier validation records. ``capacity_counts``
counts every micro-batch's capacity since the previous record (checkpoint steps are always written, so a stage's
sum is its exact mix, D.4); ``bpt = loss / ln 2``, ``bpb = bpt / bytes_per_token`` (ES-SSM Sec. 5).

Loggers beside ``metrics.jsonl`` that ``train.log`` names, given the scalars of the same records on rank 0
(docs/training.md, "Metrics and validation"): ``csv`` (``<out_dir>/metrics.csv``, long format; a resumed stage drops
the rows after its checkpoint), ``tensorboard`` (``<out_dir>/tensorboard/``) and ``wandb`` (extra ``log``)."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, tier_word
from ..config.train import LOG_SINKS as SINKS
from ..utils.files import atomic_write_bytes, with_path
from ..utils.progress import progress
from .dist import DistContext, all_reduce

__all__ = ["MetricsLogger", "validation_records", "eval_tier_list", "bytes_per_token", "read_log", "SINKS",
           "make_sinks", "scalars"]

BYTE_VOCAB = 260
_SKIP = {"kind", "stage", "step", "tier"}
CSV_FIELDS = ("kind", "stage", "step", "tier", "metric", "value")


def read_log(path: str | Path) -> str:
    """The text of a ``metrics.jsonl``; one that is not UTF-8 (records are ASCII JSON, so not a torn line but a
    damaged or foreign file) is a ``ConfigError`` naming it."""
    try:
        return Path(path).read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a JSON-lines log ({e.reason} at byte {e.start}); move it aside and resume "
                          "again (a new log is started)") from None


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


class _Sink:
    """What a sink does by default: ``drop_after`` keeps its history (TensorBoard shows a tag and step's latest value,
    W&B keeps its own; metrics.jsonl is the record of truth), ``close`` has nothing to release."""

    def drop_after(self, stage: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class CsvSink(_Sink):
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


class TensorBoardSink(_Sink):
    def __init__(self, out_dir: Path, run: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        for metric, value in scalars(record).items():
            self.writer.add_scalar(_tag(record, metric), value, int(record.get("step", 0)))

    def close(self) -> None:
        self.writer.close()


class WandbSink(_Sink):
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


class MetricsLogger:
    """JSONL records and a tqdm bar on rank 0; silent elsewhere. ``history`` keeps every train record."""

    def __init__(self, out_dir: str | Path, ctx: DistContext, progress: bool | str = True,
                 sinks: tuple[str, ...] = (), run: dict[str, Any] | None = None) -> None:
        """``progress`` as ``train``'s; ``sinks``: ``train.log``'s loggers (``log_sinks.py``), ``run`` their config."""
        self.ctx = ctx
        self.path = Path(out_dir) / "metrics.jsonl"
        self.progress = progress is True and ctx.is_main
        self.lines = progress in (True, "lines") and ctx.is_main
        self.history: list[dict[str, Any]] = []      # every train record; evals: every validation record
        self.evals: list[dict[str, Any]] = []
        self._bar, self._counts, self.sinks = None, Counter(), []
        if ctx.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.sinks = make_sinks(sinks, self.path.parent, run or {})

    def start_stage(self, stage: str, total: int, initial: int) -> None:
        self.close_bar()
        self._counts = Counter()
        if self.progress:
            self._bar = progress(total=total, initial=initial, desc=stage, unit="step", enabled=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.ctx.is_main:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:      # e.g. a full disk: name the log (a torn last line is dropped on resume)
                if e.filename is not None:
                    raise
                raise with_path(e, self.path) from e
            for sink in self.sinks:
                sink.write(record)

    def drop_after(self, stage: str, step: int) -> None:
        """Drop the records of ``stage`` after ``step`` (written after the checkpoint a run resumes from, so
        they are written again) and any torn last line."""
        for sink in self.sinks:
            sink.drop_after(stage, step)
        if not self.path.is_file():
            return

        def keep(line: str) -> bool:
            try:
                rec = json.loads(line)
            except ValueError:
                return False
            return not (rec.get("stage") == stage and int(rec.get("step", 0)) > step)
        keep_lines(self.path, read_log(self.path), keep)

    def train_step(self, record: dict[str, Any], log: bool) -> None:
        self.history.append(record)
        self._counts.update(map(str, record.get("capacities", ())))
        if log:
            self.flush(record) if self._counts else self.write(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                  lr=f"{record['lr']:.2e}", refresh=False)

    def flush(self, record: dict[str, Any]) -> None:
        """Write ``record`` (the last step's) when capacity counts are pending, e.g. before a checkpoint that an
        interrupted run resumes from (the steps after it are logged again, so no count is lost or doubled)."""
        if self._counts:
            self.write({**record, "capacity_counts": dict(self._counts)})
            self._counts = Counter()

    def eval_results(self, records: list[dict[str, Any]]) -> None:
        self.evals.extend(records)
        for r in records:
            self.write(r)
        if self.lines and records:
            loss = " ".join(f"{r['tier']}={r['loss']:.3f}" for r in records)
            acc = " ".join(f"{r['tier']}={r['accuracy']:.3f}" for r in records)
            line = f"[{records[0]['stage']} step {records[0]['step']}] val loss {loss}; accuracy {acc}"
            if self._bar is not None:
                self._bar.write(line)          # above the bar
            else:
                print(line, flush=True)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """The bar and every sink (TensorBoard's file, the W&B run)."""
        self.close_bar()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def bytes_per_token(cfg: Any, model: nn.Module) -> float:
    """``TrainConfig.eval.bytes_per_token``, or 1.0 for a 260-entry (byte) vocabulary when it is 0."""
    if cfg.eval.bytes_per_token > 0:
        return float(cfg.eval.bytes_per_token)
    return 1.0 if getattr(model.config, "vocab_size", None) == BYTE_VOCAB else 0.0


def eval_tier_list(model: nn.Module, names: Iterable[str] = ()) -> list[Any]:
    """The tiers to validate: ``names`` resolved against the model (tier words: ES-SSM ``"8"`` is K8), or every
    deployment tier."""
    names = list(names)
    return [model.resolve_tier(tier_word(n)) for n in names] if names else list(model.tier_table())


@torch.no_grad()
def validation_records(model: nn.Module, batches: list[Any], tiers: list[Any], ctx: DistContext,
                       bpt_bytes: float = 0.0, precision: str = "fp32") -> list[dict[str, Any]]:
    """``metrics.jsonl`` records of ``eval.perplexity.evaluate_tiers`` at every tier, its sums all-reduced across
    ranks: loss, tokens, accuracy and, for language models, bits per token (and per byte when ``bpt_bytes`` > 0)."""
    from ..eval.perplexity import evaluate_tiers

    classify = getattr(model.config, "task", "lm") == "classify"
    out = []
    for ev in evaluate_tiers(model, batches, tiers, bytes_per_token=bpt_bytes or 1.0, precision=precision,
                       reduce=lambda t: all_reduce(t, ctx)):
        rec: dict[str, Any] = {"kind": "eval", "tier": ev.tier, "K": ev.K, "n_ff": ev.n_ff, "loss": ev.loss,
                               "tokens": ev.tokens}
        if not classify:
            rec["bpt"] = ev.loss / math.log(2)
            if bpt_bytes > 0:
                rec["bpb"] = ev.bpb
        rec["accuracy"] = ev.accuracy
        out.append(rec)
    return out

