"""tier_profile.json / tier_quality.json across runs: a later measurement of some tiers updates those tiers and
keeps the others when the records are comparable; an incomparable saved record is kept beside the new one with
one line saying so; ``--tier auto`` says which tiers it considered and which were never timed."""

import json

import pytest

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.eval.perplexity import TierEval
from elastic_ssm.serve.select import quality_table, tier_choice, write_profile, write_quality


def _profile(tiers: dict, device="cpu", dtype="float32", params=None, date="d1"):
    return {"device": device, "torch": "2", "triton": None, "cuda": None, "dtype": dtype, "commit": None,
            "date": date, "warmup": 1, "iters": 2,
            "tiers": {t: {"ms_per_token": dict(ms), "state_bytes": 1, "params": (params or {}).get(t, 100 + i),
                          "date": date} for i, (t, ms) in enumerate(sorted(tiers.items()))}}


def _params(model):
    return {t.name: t.params for t in model.tier_table()}


def _quality(rows: dict, metric="bpb", seq_len=32, **settings):
    evals = [TierEval(t, 1, 1, p, loss, 64, 1.0, seq_len=seq_len) for t, (p, loss) in rows.items()]
    base = {"window": seq_len, "batch_size": 2, "n_batches": 2, "tokenizer": "saved", "device": "cpu",
            "dtype": "float32"}
    return quality_table(evals, "stdlib", "validation", metric, **(base | settings))


def _lines(notes):
    return lambda line: notes.append(line)


def _asides(path, stem):
    return sorted(path.glob(f"{stem}.replaced-*.json"))


def test_profile_of_a_few_tiers_updates_them_and_keeps_the_others(tiny, tmp_path):
    p = _params(tiny)
    notes = []
    write_profile(tmp_path, _profile({"T1": {"1": 1.0, "16": 2.0}, "T4": {"1": 3.0}, "T10": {"1": 9.0}},
                                     params=p), notice=_lines(notes))
    write_profile(tmp_path, _profile({"T4": {"1": 4.0}, "T1": {"1": 1.5}}, params=p, date="d2"),
                  notice=_lines(notes))
    saved = json.loads((tmp_path / "tier_profile.json").read_text())
    assert notes == [] and _asides(tmp_path, "tier_profile") == []
    assert {t: r["ms_per_token"] for t, r in saved["tiers"].items()} == {
        "T1": {"1": 1.5, "16": 2.0},       # the new batch-1 time; batch 16 was not measured again: kept
        "T4": {"1": 4.0}, "T10": {"1": 9.0}}
    assert saved["tiers"]["T10"]["date"] == "d1" and saved["tiers"]["T4"]["date"] == "d2"
    tiny.save_pretrained(tmp_path)
    # T10 still counts: a budget every tier meets picks it, not the last run's largest tier T4
    assert es.select_tier(tmp_path, max_ms_per_token=1000).name == "T10"


@pytest.mark.parametrize("change, why", [({"device": "NVIDIA H200"}, "device 'cpu' -> 'NVIDIA H200'"),
                                         ({"dtype": "bfloat16"}, "dtype 'float32' -> 'bfloat16'"),
                                         ({"params": {"T4": 7}}, "T4 params")])
def test_an_incomparable_profile_is_kept_beside_the_new_one(tmp_path, change, why):
    write_profile(tmp_path, _profile({"T1": {"1": 1.0}, "T4": {"1": 3.0}}))
    before = (tmp_path / "tier_profile.json").read_bytes()
    notes = []
    write_profile(tmp_path, _profile({"T4": {"1": 4.0}}, **change), notice=_lines(notes))
    [aside] = _asides(tmp_path, "tier_profile")
    assert aside.read_bytes() == before                      # the old record, untouched
    assert set(json.loads((tmp_path / "tier_profile.json").read_text())["tiers"]) == {"T4"}   # not mixed
    assert len(notes) == 1 and "\n" not in notes[0]
    assert why in notes[0] and aside.name in notes[0] and "now holds T4 only" in notes[0]


@pytest.mark.parametrize("body", ["{not json", "[1]", "5", '{"tiers": [1, 2]}'])
def test_an_unreadable_saved_record_is_kept_not_overwritten(tmp_path, capsys, body):
    """Not JSON, or JSON of another shape (a list: an AttributeError after the file was moved aside)."""
    (tmp_path / "tier_quality.json").write_text(body)
    write_quality(tmp_path, _quality({"T1": (10, 2.0)}))          # default notice: one line on stderr
    [aside] = _asides(tmp_path, "tier_quality")
    assert aside.read_text() == body
    assert set(json.loads((tmp_path / "tier_quality.json").read_text())["tiers"]) == {"T1"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable record" in err[0]


def test_quality_merges_only_under_the_same_settings(tmp_path):
    notes = []
    write_quality(tmp_path, _quality({f"T{i}": (i, 3.0 - 0.1 * i) for i in range(1, 11)}), notice=_lines(notes))
    write_quality(tmp_path, _quality({"T1": (1, 2.5), "T4": (4, 2.4)}), notice=_lines(notes))
    saved = json.loads((tmp_path / "tier_quality.json").read_text())
    assert notes == [] and len(saved["tiers"]) == 10
    assert saved["tiers"]["T4"]["loss"] == 2.4 and saved["tiers"]["T10"]["loss"] == pytest.approx(2.0)
    assert saved["seq_len"] == 32 and saved["window"] == 32 and saved["bytes_per_token"] == 1.0
    full = (tmp_path / "tier_quality.json").read_bytes()
    for change, why in (({"metric": "loss"}, "metric 'bpb' -> 'loss'"), ({"seq_len": 64}, "seq_len 32 -> 64"),
                        ({"device": "cuda"}, "device 'cpu' -> 'cuda'")):
        write_quality(tmp_path, _quality({"T1": (1, 2.5)}, **change), notice=_lines(notes))
        assert why in notes[-1] and "T1..T10, 10 tiers" in notes[-1]
        saved = json.loads((tmp_path / "tier_quality.json").read_text())
        assert set(saved["tiers"]) == {"T1"}
        (tmp_path / "tier_quality.json").write_bytes(full)     # the user puts the full record back
    assert len(notes) == 3 and len(_asides(tmp_path, "tier_quality")) == 3
    assert all(a.read_bytes() == full for a in _asides(tmp_path, "tier_quality"))
    # a record of an older version (no settings): kept aside, the line says what it does not record
    legacy = {"data": "stdlib", "split": "validation", "metric": "bpb", "higher_is_better": False,
              "tiers": {"T2": {"value": 1.0}}}
    (tmp_path / "tier_quality.json").write_text(json.dumps(legacy))
    write_quality(tmp_path, _quality({"T1": (1, 2.5)}), notice=_lines(notes))
    assert "it does not record seq_len" in notes[-1]
    assert any(json.loads(a.read_text()) == legacy for a in _asides(tmp_path, "tier_quality"))
    with pytest.raises(ValueError, match="unknown quality settings"):
        _quality({"T1": (1, 2.5)}, batch=3)


def test_tier_choice_says_which_tiers_it_considered(tiny, tmp_path):
    table = tiny.tier_table()
    profile = _profile({"T1": {"1": 1.0}, "T4": {"1": 3.0}}, params=_params(tiny))
    choice = tier_choice(tiny, max_ms_per_token=1000, profile=profile)
    assert choice.tier == table[3] and choice.considered == ["T1", "T4"] and choice.by == "tier order"
    assert choice.unmeasured == ["T2", "T3", "T5", "T6", "T7", "T8", "T9", "T10"]
    line = choice.line()
    assert "considered, T1,T4" in line and "T2,T3,T5-T10" in line and "a larger tier may fit too" in line
    assert "--tiers T2,T3,T5,T6,T7,T8,T9,T10 --batches 1" in line and "\n" not in line
    # a tier that misses another budget is not "unmeasured": it would not fit anyway
    choice = tier_choice(tiny, max_ms_per_token=1000, max_params=table[4].params, profile=profile)
    assert choice.unmeasured == ["T2", "T3", "T5"] and choice.tier.name == "T4"
    # only smaller tiers untimed: the chosen tier is the largest there is
    choice = tier_choice(tiny, max_ms_per_token=1000, profile=_profile({"T10": {"1": 9.0}}))
    assert choice.tier.name == "T10" and "a larger tier may fit too" not in choice.line()
    # a quality record that does not score every fitting tier falls back to tier order, and says so
    quality = _quality({"T1": (1, 1.0), "T4": (4, 3.0)})
    choice = tier_choice(tiny, max_params=table[5].params, quality=quality)
    assert choice.tier.name == "T6" and choice.unscored == ["T2", "T3", "T5", "T6"]
    assert "does not score T2,T3,T5,T6" in choice.line()
    choice = tier_choice(tiny, max_params=table[3].params, quality=_quality(
        {f"T{i}": (i, 2.0 if i == 2 else 3.0) for i in range(1, 5)}))
    assert choice.tier.name == "T2" and "best bpb in tier_quality.json" in choice.line()
    assert es.select_tier(tiny, max_ms_per_token=1000, profile=profile) == table[3]


def test_calibrate_and_generate_across_runs(tiny, tmp_path, capsys):
    d = tmp_path / "m"
    tiny.save_pretrained(d)
    run = ["--batches", "1", "--warmup", "0", "--iters", "1"]
    assert main(["calibrate", str(d), "--tiers", "T1, T4", *run]) == 0
    assert main(["calibrate", str(d), "--tiers", "T4", *run]) == 0
    assert set(json.loads((d / "tier_profile.json").read_text())["tiers"]) == {"T1", "T4"}
    capsys.readouterr()
    assert main(["generate", str(d), "--tier", "auto", "--max-ms-per-token", "1e9", "--prompt", "x",
                 "--max-new-tokens", "1"]) == 0
    [line] = [x for x in capsys.readouterr().err.splitlines() if "--tier auto" in x]
    assert line.startswith("--tier auto: T4 (") and "considered, T1,T4" in line
    assert "never timed at batch >= 1 in tier_profile.json: T2,T3,T5-T10 (a larger tier may fit too)" in line
    assert main(["calibrate", str(d), "--tiers", "T2,T3,T5,T6,T7,T8,T9,T10", *run]) == 0
    assert len(json.loads((d / "tier_profile.json").read_text())["tiers"]) == 10
    capsys.readouterr()
    assert main(["generate", str(d), "--tier", "auto", "--max-ms-per-token", "1e9", "--prompt", "x",
                 "--max-new-tokens", "1"]) == 0
    assert "--tier auto: T10 (" in capsys.readouterr().err
    before = (d / "tier_profile.json").read_bytes()
    assert main(["calibrate", str(d), "--tiers", "T1", "--dtype", "bfloat16", *run]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "not comparable" in x]
    [aside] = _asides(d, "tier_profile")
    assert len(err) == 1 and "dtype 'float32' -> 'bfloat16'" in err[0] and aside.name in err[0]
    assert aside.read_bytes() == before


def test_eval_updates_the_quality_record_and_keeps_an_incomparable_one(tiny, tmp_path, capsys):
    d = tmp_path / "m"
    tiny.save_pretrained(d)
    small = ["--seq_len", "32", "--batch_size", "2", "--n_batches", "2", "--write_quality"]
    assert main(["eval", str(d), "--tiers", "all", *small]) == 0
    full = json.loads((d / "tier_quality.json").read_text())
    assert len(full["tiers"]) == 10 and full["metric"] == "bpb" and full["window"] == 32
    assert full["device"] == "cpu" and full["dtype"] == "float32" and full["n_batches"] == 2
    assert main(["eval", str(d), "--tiers", "T1,T4,0.45", *small]) == 0       # comparable: merged
    assert json.loads((d / "tier_quality.json").read_text())["tiers"] == full["tiers"]   # same numbers again
    capsys.readouterr()
    assert main(["eval", str(d), "--tiers", "T1,0.45", "--quality_metric", "loss", *small]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "not comparable" in x]
    [aside] = _asides(d, "tier_quality")
    assert len(err) == 1 and "metric 'bpb' -> 'loss'" in err[0] and aside.name in err[0]
    assert json.loads(aside.read_text())["tiers"] == full["tiers"]           # all ten bpb entries kept
    now = json.loads((d / "tier_quality.json").read_text())
    assert now["metric"] == "loss" and set(now["tiers"]) == {"T1"}
    # --lengths scores tokens cut from the longest windows: not the same windows as --seq-len 32
    assert main(["eval", str(d), "--tiers", "T1", "--lengths", "32,64", "--quality_metric", "loss",
                 "--batch_size", "2", "--n_batches", "2", "--write_quality"]) == 0
    assert "window 32 -> 64" in capsys.readouterr().err
    assert len(_asides(d, "tier_quality")) == 2
