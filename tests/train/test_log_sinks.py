"""Loggers beside metrics.jsonl (issue 41 item 4): ``train.log`` csv / tensorboard / wandb get the same records
as the JSONL, the JSONL stays the record of truth, a resumed stage drops the CSV rows after its checkpoint, and
an unknown logger is one line."""

import csv
import json
import warnings

import pytest

from elastic_ssm.cli import main
from elastic_ssm.train.metrics import scalars

RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: 4, micro_batch_size: 2, seq_len: 32, log_every: 1, device: cpu,
        mixing: {n_warm_tokens: 64}, eval: {every: 2, batches: 1, tiers: [T1, T10]},
        checkpoint: {every: 2, keep_last: 2}, log: LOGGERS}
data: {source: CORPUS, tokenizer: bytes}
"""


def _run(tmp_path, loggers, *extra):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.replace("LOGGERS", json.dumps(loggers)).replace("CORPUS", str(corpus)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["train", "--config", str(cfg), "--train.out_dir", str(tmp_path / "run"), *extra])
    return rc, tmp_path / "run"


def _jsonl(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _expected_rows(records):
    return sorted((r.get("kind", ""), r.get("stage", ""), str(r.get("step", "")), r.get("tier", ""), k, v)
                  for r in records for k, v in scalars(r).items())


def _csv_rows(run):
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["kind", "stage", "step", "tier", "metric", "value"]
    return sorted((*r[:5], float(r[5])) for r in rows[1:])


def test_csv_holds_every_scalar_of_the_jsonl(tmp_path):
    rc, run = _run(tmp_path, ["csv"])
    assert rc == 0
    records = _jsonl(run)
    assert {r["kind"] for r in records} == {"train", "eval"}
    assert _csv_rows(run) == _expected_rows(records)


def test_a_resumed_stage_drops_the_csv_rows_after_its_checkpoint(tmp_path):
    rc, run = _run(tmp_path, ["csv"], "--stop-after", "3")
    assert rc == 0
    rc, run = _run(tmp_path, ["csv"], "--resume")
    assert rc == 0
    assert _csv_rows(run) == _expected_rows(_jsonl(run))     # step 3 logged once, as in the JSONL


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the log extra is installed by the dev extra; CI runs these")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rc, run = _run(tmp_path, ["tensorboard"])
    assert rc == 0
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    records = _jsonl(run)
    train = [r for r in records if r["kind"] == "train" and r["stage"] == "pretrain"]
    got = {e.step: e.value for e in acc.Scalars("pretrain/loss")}
    assert got == pytest.approx({r["step"]: r["loss"] for r in train})
    evals = [r for r in records if r["kind"] == "eval" and r["tier"] == "T1" and r["stage"] == "pretrain"]
    got = {e.step: e.value for e in acc.Scalars("pretrain/eval/T1/bpb")}
    assert got == pytest.approx({r["step"]: r["bpb"] for r in evals})


def test_wandb_runs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the log extra is installed by the dev extra; CI runs these")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rc, run = _run(tmp_path, ["wandb", "csv"])
    assert rc == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # the run file is W&B's protobuf log (no reader ships with wandb's Go core): each history record carries its
    # keys and JSON values as plain strings, so every logged train loss must appear in it
    blob = files[0].read_bytes()
    train = [r for r in _jsonl(run) if r["kind"] == "train"]
    assert b"pretrain/loss" in blob and b"pretrain/eval/T10/bpb" in blob
    assert all(json.dumps(r["loss"]).encode() in blob for r in train)


def test_an_unknown_logger_is_one_line(tmp_path, capsys):
    rc, run = _run(tmp_path, ["mlflow"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log" in err[0] and "mlflow" in err[0] and "tensorboard" in err[0], err
    assert not (run / "metrics.jsonl").exists()
