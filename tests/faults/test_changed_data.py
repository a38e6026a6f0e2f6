"""A resumed run refuses training tokens that differ from its checkpoint's (the data files were edited, reordered
or replaced since the save): it would otherwise continue on other batches without a word."""

from pathlib import Path

import numpy as np
import pytest

from elastic_ssm.cli import main as cli_main
from elastic_ssm.data.packing import PackedBatches, tokens_fingerprint


def test_fingerprint_follows_content_and_length():
    a = np.arange(1_000_000) % 251
    assert tokens_fingerprint(a) == tokens_fingerprint(a.copy())
    assert tokens_fingerprint(a) != tokens_fingerprint(a[::-1].copy())         # same length, reordered
    assert tokens_fingerprint(a) != tokens_fingerprint(a[:-1])                  # one token shorter
    small = np.arange(100)
    edited = small.copy()
    edited[50] += 1
    assert tokens_fingerprint(small) != tokens_fingerprint(edited)              # short streams: every token


def test_packed_batches_refuse_other_tokens_on_resume():
    tokens = np.arange(50_000) % 200
    first = PackedBatches(tokens, 16, 4, seed=0)
    next(first)
    state = first.state_dict()
    same = PackedBatches(tokens.copy(), 16, 4, seed=0)
    same.load_state_dict(state)
    assert np.array_equal(next(same)[0].numpy(), next(first)[0].numpy())
    other = PackedBatches(tokens[::-1].copy(), 16, 4, seed=0)
    with pytest.raises(ValueError, match="training tokens differ"):
        other.load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "tokens"}                   # a checkpoint from before the check
    PackedBatches(tokens[::-1].copy(), 16, 4, seed=0).load_state_dict(older)


def test_cli_resume_on_an_edited_corpus_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(2000)))
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    run = ["train", "--config", str(config), "--data.source", str(corpus), "--train.steps", "20",
           "--train.refine.steps", "0", "--train.out_dir", str(tmp_path / "r")]
    assert cli_main(run + ["--stop_after", "5"]) == 0
    corpus.write_text(corpus.read_text()[::-1])
    capsys.readouterr()
    assert cli_main(run + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training tokens differ" in err[0], err
    assert (tmp_path / "r" / "pretrain" / "step_0000005" / "COMPLETE.json").is_file()
