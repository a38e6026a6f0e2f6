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
    assert cli_main(["eval", str(saved / "m"), "--data", str(saved / "code.txt"), "--seq_len", "64",
                     "--batch_size", "8", "--n_batches", "4", "--tiers", "T1", "--no_write_quality"]) == 0
    said = capsys.readouterr().out
    assert "fewer than the 32 asked (--batch_size 8 x --n_batches 4)" in said


def test_importance_counts_every_channel_of_a_small_tier_by_default(saved, capsys):
    args = ["importance", str(saved / "t1"), "--data", str(saved / "code.txt"), "--seq_len", "32",
            "--batch_size", "2", "--n_batches", "1", "--out", str(saved / "imp")]
    assert cli_main(args) == 0                                 # default --first 8 > the export's channels
    out = capsys.readouterr()
    assert "the first-N share counts all" in out.out and (saved / "imp" / "channel_importance.json").is_file()
    assert cli_main(args[:-2] + ["--first", "7", "--out", str(saved / "imp2")]) == 2     # asked for: refused
    assert "--first 7 exceeds the" in capsys.readouterr().err and not (saved / "imp2").exists()


def test_importance_names_its_own_flag_and_leaves_no_empty_folder(saved, capsys):
    assert cli_main(["importance", str(saved / "m"), "--tier", "T11"]) == 2
    assert "--tier T11: unknown tier 'T11'" in capsys.readouterr().err
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


@pytest.mark.parametrize("arch", ["transformer", "matformer"])
def test_importance_of_a_model_without_spectral_channels_is_refused_before_any_work(saved, capsys, arch):
    """A Transformer++ or MatFormer has no channels to knock out: one line naming the arch, no warning about
    --first (which the user never gave), and no --out folder."""
    from elastic_ssm.config import model_config_from_dict
    from elastic_ssm.models import build_model

    build_model(model_config_from_dict({"arch": arch, "preset": "tiny"}), seed=0).save_pretrained(saved / arch)
    out = saved / f"imp-{arch}"
    assert cli_main(["importance", str(saved / arch), "--data", str(saved / "code.txt"), "--seq_len", "32",
                     "--n_batches", "1", "--out", str(out)]) == 2
    said = capsys.readouterr()
    assert said.err.count("\n") == 1 and "--first" not in said.err and not said.out, said
    assert f"holds a '{arch}' model: it has no spectral channels; importance applies to ESSH and ES-SSM" in said.err
    assert not out.exists()


def test_eval_and_importance_default_to_the_longest_sequence_a_small_es_ssm_accepts(saved, capsys):
    """Without --seq_len an ES-SSM of filter length 128 is scored on 128-token windows (the default 512 exceeds
    it), said in a status line and in --help; a --seq_len the user gives beyond it is refused naming the flag."""
    es.ESSSM(es.ESSSMConfig.preset("tiny", seq_len=128)).save_pretrained(saved / "es")
    csv = saved / "es.csv"
    assert cli_main(["eval", str(saved / "es"), "--data", str(saved / "code.txt"), "--batch_size", "1",
                     "--n_batches", "1", "--tiers", "K8", "--no_write_quality", "--csv", str(csv)]) == 0
    assert "--seq_len 128: the longest sequence this es_ssm model accepts" in capsys.readouterr().out
    assert ",128," in csv.read_text().splitlines()[1]
    out = saved / "imp-es"
    assert cli_main(["importance", str(saved / "es"), "--data", str(saved / "code.txt"), "--batch_size", "1",
                     "--n_batches", "1", "--out", str(out)]) == 0
    assert (out / "channel_importance.json").is_file()
    capsys.readouterr()
    assert cli_main(["eval", str(saved / "es"), "--data", str(saved / "code.txt"), "--seq_len", "200"]) == 2
    assert "--seq_len: 200 tokens exceed this ES-SSM model's filter length 128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["eval", "--help"])
    assert "or the model's longest sequence" in " ".join(capsys.readouterr().out.split())
