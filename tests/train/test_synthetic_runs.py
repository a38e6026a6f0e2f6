"""Synthetic recall tasks as a run's data source (``data.source: synthetic:mqar...``, ESSH Appendix I):
option parsing and errors, per-rank streams, a bit-exact resume, and a CLI run whose validation reports
recall accuracy for every tier."""

import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.data.synthetic import IGNORE, SyntheticSource, synthetic_batches
from elastic_ssm.train import TrainConfig, train

MQAR_RUN = """
model: {arch: essh, preset: tiny, vocab_size: 64}
train: {recipe: capacity_mixed, steps: 4, micro_batch_size: 2, grad_accum: 4, seq_len: 32,
        mixing: {n_warm_tokens: 64}, ordering: {every: 2}, eval: {every: 2, batches: 2}, checkpoint: {every: 2},
        log_every: 1}
data: {source: "synthetic:mqar:num_pairs=4"}
"""


def test_source_options_and_errors():
    src = SyntheticSource("synthetic:mqar:num_pairs=4,num_queries=2", vocab_size=64)
    assert src.task == "mqar" and src.kwargs == {"vocab_size": 64, "num_pairs": 4, "num_queries": 2}
    val = src.validation(seq_len=32, batch_size=4, n_batches=3, seed=0)
    assert len(val) == 3 and all(int((y != IGNORE).sum(1).min()) == 2 for _, y in val)
    assert SyntheticSource("synthetic:palindrome", 16).kwargs == {"vocab_size": 16}
    for bad, match in [("synthetic:copy", "synthetic:<task>"), ("mqar", "synthetic:<task>"),
                       ("synthetic:mqar:pairs=4", "unknown option"), ("synthetic:mqar:num_pairs=four", "key=integer"),
                       ("synthetic:mqar:vocab_size=128", "model has 64")]:
        with pytest.raises(ValueError, match=match):
            SyntheticSource(bad, vocab_size=64)
    with pytest.raises(ValueError, match="too short"):
        SyntheticSource("synthetic:mqar:num_pairs=20", 64).validation(seq_len=32, batch_size=2, n_batches=1, seed=0)


def test_each_rank_draws_its_own_stream_and_rank_zero_keeps_the_documented_one():
    make = SyntheticSource("synthetic:mqar:num_pairs=4", 64).batches(seq_len=32, batch_size=4, seed=3)
    r0, r1 = next(iter(make(0, 2))), next(iter(make(1, 2)))
    assert not torch.equal(r0[0], r1[0])
    ref = next(synthetic_batches("mqar", 4, 32, seed=3, num_pairs=4, vocab_size=64))
    assert torch.equal(r0[0], ref[0]) and torch.equal(r0[1], ref[1])


def test_resume_on_a_synthetic_stream_is_bit_exact(tmp_path):
    cfg = es.ESSHConfig.preset("tiny", vocab_size=64)
    make = SyntheticSource("synthetic:mqar:num_pairs=4", 64).batches(seq_len=32, batch_size=2, seed=0)

    def tcfg(out):
        return TrainConfig(steps=4, micro_batch_size=2, grad_accum=4, seq_len=32, mixing={"n_warm_tokens": 64},
                           ordering={"every": 2}, eval={"every": 0}, checkpoint={"every": 2}, out_dir=str(out),
                           seed=0)

    straight = train(cfg, make, tcfg(tmp_path / "a"), progress=False)
    train(cfg, make, tcfg(tmp_path / "b"), progress=False, stop_after=2)
    rest = train(cfg, make, tcfg(tmp_path / "b"), progress=False, resume=True)
    a, b = straight.model.state_dict(), rest.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mqar_run_through_the_cli_reports_recall_accuracy_per_tier(tmp_path, capsys):
    (tmp_path / "mqar.yaml").write_text(MQAR_RUN)
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "mqar.yaml"), "--train.out_dir", str(out)]) == 0
    assert "synthetic:mqar:num_pairs=4: fresh batches every step" in capsys.readouterr().out
    evals = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "eval"]
    assert {r["tier"] for r in evals} >= {"T1", "T10"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and "bpb" not in r and r["tokens"] == 2 * 2 * 4 for r in evals)
    bad = tmp_path / "bad.yaml"
    bad.write_text(MQAR_RUN.replace("num_pairs=4", "num_pairs=20"))
    assert main(["train", "--config", str(bad), "--train.out_dir", str(tmp_path / "bad")]) == 2
    assert "too short" in capsys.readouterr().err
