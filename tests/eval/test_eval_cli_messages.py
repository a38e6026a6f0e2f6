"""``eval`` and ``importance`` on small data and small tiers: they say what they do instead of failing or
scoring fewer tokens silently, name the flag the user gave, and a failed importance leaves no empty folder."""

import pytest

import elastic_ssm as es
from elastic_ssm.cli import main as cli_main
from elastic_ssm.data import ByteTokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcli")
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.tokenizer = ByteTokenizer()
    model.save_pretrained(root / "m")
    es.export_tier(model, "T1").save_pretrained(root / "t1")
    (root / "code.txt").write_text("def f(x):\n    return x + 1\n" * 300)
    return root


def test_eval_says_when_the_data_holds_fewer_windows_than_asked(saved, capsys):
    assert cli_main(["eval", str(saved / "m"), "--data", str(saved / "code.txt"), "--seq-len", "64",
                     "--batch-size", "8", "--n-batches", "4", "--tiers", "T1", "--no-write-quality"]) == 0
    said = capsys.readouterr().out
    assert "fewer than the 32 asked (--batch-size 8 x --n-batches 4)" in said


def test_importance_counts_every_channel_of_a_small_tier_by_default(saved, capsys):
    args = ["importance", str(saved / "t1"), "--data", str(saved / "code.txt"), "--seq-len", "32",
            "--batch-size", "2", "--n-batches", "1", "--out", str(saved / "imp")]
    assert cli_main(args) == 0                                 # default --first 8 > the export's channels
    out = capsys.readouterr()
    assert "the first-N share counts all" in out.out and (saved / "imp" / "channel_importance.json").is_file()
    assert cli_main(args[:-2] + ["--first", "7", "--out", str(saved / "imp2")]) == 2     # asked for: refused
    assert "--first 7 exceeds the" in capsys.readouterr().err and not (saved / "imp2").exists()


def test_importance_names_its_own_flag_and_leaves_no_empty_folder(saved, capsys):
    assert cli_main(["importance", str(saved / "m"), "--tier", "T11"]) == 2
    assert "--tier 'T11'" in capsys.readouterr().err
    (saved / "empty.txt").write_text("")
    out = saved / "never"
    assert cli_main(["importance", str(saved / "m"), "--data", str(saved / "empty.txt"), "--out", str(out)]) == 2
    capsys.readouterr()
    assert not out.exists()


def test_a_file_too_small_for_its_validation_split_is_named_as_such(saved, capsys):
    (saved / "tiny.txt").write_text("abc")
    assert cli_main(["eval", str(saved / "m"), "--data", str(saved / "tiny.txt")]) == 2
    err = capsys.readouterr().err
    assert "holds 3 bytes, too few to give its validation split any text" in err
