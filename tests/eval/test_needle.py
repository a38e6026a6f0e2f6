"""Needle-in-a-haystack evaluator (``eval/perplexity.py``): trial layout, metrics against a model that can
retrieve (an induction-head oracle) and one that cannot, per-trial scores equal the model's own
log-probabilities, the item-cluster bootstrap, and the CLI on a trained-from-scratch tiny model."""

import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.data import ByteTokenizer, load_corpus
from elastic_ssm.eval.perplexity import (
    NeedleConfig,
    _bootstrap_half_width,
    build_trials,
    evaluate_needle,
    score_trials,
    summarize_needle,
)

TOK = ByteTokenizer()
FILLER = np.frombuffer(b"the grass is green and the sky is blue; " * 40, dtype=np.uint8).astype(np.int64)


class _Tier:
    name, K, n_ff, params = "full", 0, 0, 0


class InductionOracle(nn.Module):
    """Predicts the token that followed the latest earlier occurrence of the last ``span`` tokens (an
    induction head); uniform where there is none. It retrieves any needle the query repeats the prefix of."""

    def __init__(self, vocab=260, span=12):
        super().__init__()
        self.config = es.ESSHConfig.preset("tiny")
        self.span, self.vocab = span, vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def resolve_tier(self, t):
        return _Tier()

    def forward(self, x, tier=None):
        B, T = x.shape
        out = torch.zeros(B, T, self.vocab)
        for b in range(B):
            seq = x[b].tolist()
            for t in range(self.span - 1, T):
                key = seq[t - self.span + 1:t + 1]
                for s in range(t - 1, self.span - 2, -1):
                    if seq[s - self.span + 1:s + 1] == key:
                        out[b, t, seq[s + 1]] = 10.0
                        break
        return out


class Blind(InductionOracle):
    def forward(self, x, tier=None):
        return torch.zeros(*x.shape, self.vocab)


def test_trials_have_the_requested_length_depth_and_keys():
    cfg = NeedleConfig(context_len=200, n_pairs=3, depths=(0.0, 0.5, 1.0))
    trials = build_trials(FILLER, TOK, cfg)
    assert len(trials) == 9 and [t.depth for t in trials[:3]] == [0.0, 0.5, 1.0]
    for t in trials:
        assert len(t.prompt) == 200 and len(t.expected) == 6 and t.expected != t.competitor
        needle = TOK.encode(cfg.needle.format(key=TOK.decode(t.expected)))
        assert t.prompt[t.needle_at:t.needle_at + len(needle)] == needle
        assert TOK.decode(t.prompt).endswith(cfg.query)
    # the three depths of a pair share keys and filler; pairs differ
    assert trials[0].expected == trials[2].expected and trials[0].expected != trials[3].expected
    planted = build_trials(FILLER, TOK, NeedleConfig(context_len=200, n_pairs=3, condition="planted"))
    assert planted[0].expected == trials[0].competitor and planted[0].competitor == trials[0].expected


class SpaceDigitTokenizer:
    """Bytes, except that a space before a digit merges with it into one token (as GPT-2's BPE does)."""

    vocab_size = 266

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text) and text[i + 1].isdigit():
                out.append(256 + int(text[i + 1]))
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def decode(self, ids):
        return "".join(" " + str(i - 256) if i >= 256 else chr(i) for i in ids)


def test_keys_take_the_querys_trailing_space_when_the_tokenizer_merges_it():
    tok = SpaceDigitTokenizer()
    filler = np.asarray(tok.encode("the grass is green " * 40))
    cfg = NeedleConfig(context_len=160, n_pairs=3, depths=(0.5,))
    for t in build_trials(filler, tok, cfg):
        key = tok.decode(t.expected)
        assert key[0] == " " and key[1:].isdigit() and len(key) == 7 and t.expected[0] >= 256
        assert tok.decode(t.prompt + t.expected).endswith("The special magic number is" + key)
        assert tok.decode(t.competitor)[0] == " "
    byte_trial = build_trials(FILLER, TOK, NeedleConfig(context_len=200, n_pairs=1))[0]
    assert TOK.decode(byte_trial.expected).isdigit()               # bytes: the key is the digits alone


def test_a_model_that_retrieves_scores_one_and_a_blind_model_zero():
    cfg = NeedleConfig(context_len=160, n_pairs=2, depths=(0.1, 0.9), bootstrap=200)
    trials = build_trials(FILLER, TOK, cfg)
    good = summarize_needle(score_trials(InductionOracle(), trials, batch_size=3), cfg)
    assert good["full_key"] == good["first_token"] == good["margin_win"] == 1.0
    assert good["by_depth"] == {"0.1": 1.0, "0.9": 1.0} and good["half_width"] == 0.0
    bad = summarize_needle(score_trials(Blind(), trials), cfg)
    assert bad["full_key"] == bad["first_token"] == bad["margin_win"] == 0.0


def test_trial_scores_equal_the_models_log_probabilities():
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    cfg = NeedleConfig(context_len=160, n_pairs=2, depths=(0.5,))
    trials = score_trials(model, build_trials(FILLER, TOK, cfg), tier="T4", batch_size=2)
    for t in trials:
        scores = []
        for key in (t.expected, t.competitor):
            x = torch.tensor([t.prompt + key[:-1]])
            with torch.no_grad():
                lp = F.log_softmax(model(x, tier="T4")[0, len(t.prompt) - 1:].float(), -1)
            scores.append(lp.gather(-1, torch.tensor(key)[:, None]).sum().item())
            if key is t.expected:
                hits = (lp.argmax(-1) == torch.tensor(key)).tolist()
        assert t.result == {"full_key": all(hits), "first_token": hits[0], "margin_win": scores[0] > scores[1]}


def test_bootstrap_resamples_pairs_with_their_depths():
    grid = np.array([[1, 1], [0, 0], [1, 0], [0, 1]], dtype=float)     # 4 pairs x 2 depths, mean 0.5
    hw = _bootstrap_half_width(grid, 4000, seed=0)
    # pair means are 1, 0, 0.5, 0.5: std 0.354; the 95% interval of a 4-pair mean is about +-0.35
    assert 0.2 < hw < 0.45
    assert _bootstrap_half_width(np.ones((5, 3)), 100, 0) == 0.0


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="condition"):
        build_trials(FILLER, TOK, NeedleConfig(condition="both"))
    with pytest.raises(ValueError, match="no room"):
        build_trials(FILLER, TOK, NeedleConfig(context_len=40))
    with pytest.raises(ValueError, match="filler corpus"):
        build_trials(FILLER[:100], TOK, NeedleConfig(context_len=400))


def test_every_tier_through_the_cli(tmp_path):
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    rows = evaluate_needle(model, load_corpus("stdlib", TOK, split="validation", max_bytes=50_000), TOK,
                           ["T1", "T10"], NeedleConfig(context_len=160, n_pairs=4, bootstrap=100))
    assert [r["tier"] for r in rows] == ["T1", "T10"]
    assert all(r["trials"] == 20 and 0 <= r["full_key"] <= r["first_token"] <= 1 for r in rows)
    model.save_pretrained(tmp_path / "m")
    out = tmp_path / "niah.csv"
    assert main(["niah", str(tmp_path / "m"), "--tiers", "T1,T10", "--context_len", "160", "--n_pairs", "4",
                 "--csv", str(out)]) == 0
    with open(out) as f:
        got = list(csv.DictReader(f))
    assert [r["tier"] for r in got] == ["T1", "T10"] and "d0.5" in got[0]
    assert main(["niah", str(tmp_path / "m"), "--context_len", "20", "--n_pairs", "1"]) == 2     # named error


def test_an_es_ssm_context_beyond_its_filters_is_refused_naming_the_largest_that_fits(tmp_path, capsys):
    """A trial's forward holds the context and all but the last answer token: on an ES-SSM of filter length 128
    the largest context is 128 - 5 (six-digit keys, bytes). A longer one, the default 2048 included, is one line
    naming --context-len and that value, before any scoring; the value itself runs."""
    model = es.ESSSM(es.ESSSMConfig.preset("tiny", seq_len=128)).eval()
    filler = load_corpus("stdlib", TOK, split="validation", max_bytes=50_000)
    with pytest.raises(ValueError, match=r"context_len=128 makes forwards of 133 tokens.*give context_len=123 or"):
        evaluate_needle(model, filler, TOK, ["K8"], NeedleConfig(context_len=128, n_pairs=1, depths=(0.5,)))
    rows = evaluate_needle(model, filler, TOK, ["K8"], NeedleConfig(context_len=123, n_pairs=1, depths=(0.5,)))
    assert rows[0]["trials"] == 1 and rows[0]["context_len"] == 123
    model.save_pretrained(tmp_path / "es")
    for given in ([], ["--context_len", "128"]):
        assert main(["niah", str(tmp_path / "es"), "--n_pairs", "1", *given]) == 2
        said = capsys.readouterr()
        assert said.err.count("\n") == 1 and not said.out, said
        assert "--context_len 123 or less" in said.err and "accepts" in said.err, said.err
    assert main(["niah", str(tmp_path / "es"), "--context_len", "123", "--n_pairs", "1", "--depths", "0.5"]) == 0
