"""``elastic-ssm eval`` beyond the tier table: capacity fractions training never sampled (exact counts of the
two-rate map, Eq. 7) mixed with named tiers, and the length sweep at multiples of the training length."""

import csv
import inspect
import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.cli_eval import parse_lengths
from elastic_ssm.elastic.tiers import capacity_tier
from elastic_ssm.eval.perplexity import split_windows

EVAL = ["--batch_size", "2", "--n_batches", "1", "--no_write_quality"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A saved tiny ESSH as a run's final/ (run.yaml beside it says train.seq_len 16) and a text corpus."""
    root = tmp_path_factory.mktemp("sweep")
    torch.manual_seed(0)
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(root / "run" / "final")
    (root / "run" / "run.yaml").write_text("model: {arch: essh, preset: tiny}\ntrain: {seq_len: 16}\n")
    (root / "c.txt").write_text(inspect.getsource(json))
    return root


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_capacity_fractions_mix_with_named_tiers_with_exact_counts(run, capsys):
    out = run / "cap.csv"
    assert main(["eval", str(run / "run" / "final"), "--data", str(run / "c.txt"), "--seq_len", "16", *EVAL,
                 "--tiers", "0.3,T4,0.62", "--csv", str(out)]) == 0
    rows = _rows(out)
    cfg = es.ESSHConfig.preset("tiny")
    assert [r["tier"] for r in rows] == ["xi=0.3", "T4", "xi=0.62"]
    for r, xi in zip(rows, (0.3, cfg.tier_xi[3], 0.62)):
        t = capacity_tier(cfg, xi)
        assert float(r["xi"]) == xi and (int(r["K"]), int(r["n_ff"]), int(r["params"])) == (t.K, t.n_ff, t.params)
        assert float(r["bpb"]) > 0
    assert "xi" in capsys.readouterr().out.splitlines()[0]
    # a fraction runs the shared model at its capacity: 0.3 keeps T4's K and n_ff here, so the same loss
    assert (rows[0]["K"], rows[0]["n_ff"]) == (rows[1]["K"], rows[1]["n_ff"]) and rows[0]["loss"] == rows[1]["loss"]
    assert rows[2]["loss"] != rows[1]["loss"]


def test_length_sweep_at_multiples_of_the_run_training_length(run, capsys):
    out = run / "len.csv"
    assert main(["eval", str(run / "run" / "final"), "--data", str(run / "c.txt"), *EVAL, "--tiers", "T1,T10",
                 "--lengths", "1x,2x,4x", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "training length 16 (from" in text and "L=64" in text
    rows = _rows(out)
    assert [(r["tier"], int(r["seq_len"])) for r in rows] == [(t, n) for n in (16, 32, 64) for t in ("T1", "T10")]
    assert all(int(r["tokens"]) == 2 * 64 for r in rows)      # the same tokens scored at every length
    assert main(["eval", str(run / "run" / "final"), "--data", str(run / "c.txt"), *EVAL, "--tiers", "T2",
                 "--lengths", "2x,20", "--train_len", "12", "--csv", str(out), "--overwrite"]) == 0   # replaces len.csv
    assert [int(r["seq_len"]) for r in _rows(out)] == [24, 20]


def test_split_windows_keeps_every_label_token_in_order():
    x = torch.arange(2 * 12).reshape(2, 12)
    batches = [(x, x + 1)]
    for n in (12, 6, 4, 3):
        (xs, ys), = split_windows(batches, n)
        assert xs.shape == (2 * 12 // n, n) and torch.equal(ys.flatten(), (x + 1).flatten())
        assert torch.equal(ys, xs + 1)                 # every label still follows its own input token
    (xs, ys), = split_windows(batches, 5)              # 12 // 5 = 2 pieces per row, the tail is dropped
    assert torch.equal(xs, torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]))
    with pytest.raises(ValueError, match="pieces of 13"):
        split_windows(batches, 13)


def test_parse_lengths():
    assert parse_lengths("1x,2x,8X", 256) == [256, 512, 2048]
    assert parse_lengths("1000,1.5x", 100) == [1000, 150]
    with pytest.raises(es.config.ConfigError, match="--train_len"):
        parse_lengths("2x", None)
    for bad in ("0x", "-5", "abc", "nanx"):
        with pytest.raises(es.config.ConfigError, match="--lengths"):
            parse_lengths(bad, 16)
