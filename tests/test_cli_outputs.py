"""What the writing verbs do with outputs that already exist (export, tokenizer train, prepare, the --csv of eval /
niah / lm-eval), generate's --prompt that is not UTF-8, and eval's writes into the model directory. The tier words
of every verb: ``test_cli_tier_names.py``."""

import json

import pytest

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.cli_util import write_csv
from elastic_ssm.config import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(path)
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("elastic-ssm ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def export(model_dir, out, *flags):
    return main(["export", str(model_dir), "--out", str(out), "--check_len", "8", *flags])


def tier_of(folder) -> str:
    return json.loads((folder / "config.json").read_text())["source"]["tier"]


# ---- 1. export never replaces a saved model without --overwrite -------------------------------------------------
def test_export_refuses_a_tier_folder_that_holds_another_model(model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    assert export(model_dir, out, "--tiers", "T1,T4") == 0
    assert tier_of(out / "T1") == "T1"
    # another model put where T1 was exported: its weights must survive a second export
    (out / "T1" / "model.safetensors").write_bytes(b"someone else's weights")
    (out / "T1" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export(model_dir, out, "--tiers", "T1") == 2
    line = one_error_line(capsys)
    assert str(out / "T1") in line and "already holds files" in line and "--overwrite" in line
    assert (out / "T1" / "model.safetensors").read_bytes() == b"someone else's weights"
    assert (out / "T1" / "notes.txt").read_text() == "mine"


def test_export_refusal_comes_before_any_tier_is_written(model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    (out / "T4").mkdir(parents=True)
    (out / "T4" / "model.safetensors").write_bytes(b"kept")
    assert export(model_dir, out, "--tiers", "T1,T4") == 2     # T1 comes first but is not written either
    assert "T4" in one_error_line(capsys)
    assert not (out / "T1").exists()
    assert (out / "T4" / "model.safetensors").read_bytes() == b"kept"


def test_export_of_the_same_model_again_is_refused_too(model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    assert export(model_dir, out, "--tiers", "T2") == 0
    before = (out / "T2" / "config.json").read_bytes()
    capsys.readouterr()
    assert export(model_dir, out, "--tiers", "T2") == 2       # documented: exports are not byte-reproducible
    assert "--overwrite" in one_error_line(capsys)
    assert (out / "T2" / "config.json").read_bytes() == before


def test_export_of_a_tier_named_twice_writes_it_once(model_dir, tmp_path, capsys):
    """``--tiers T4,T4`` (or ``T10,full``) saved the tier twice into one folder, the second time over the first
    without --overwrite, and counted two models."""
    assert export(model_dir, tmp_path / "exp", "--tiers", "T4, T4,full,T10") == 0
    assert "wrote 2 standalone model(s)" in capsys.readouterr().out


def test_export_overwrite_replaces_the_whole_tier_folder(model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    (out / "T1").mkdir(parents=True)
    (out / "T1" / "model.safetensors").write_bytes(b"old")
    (out / "T1" / "tokenizer.json").write_text("{}")        # a stale file of the old model must not stay beside it
    (out / "T3").mkdir()
    (out / "T3" / "config.json").write_text("{}")
    assert export(model_dir, out, "--tiers", "T1,T3", "--overwrite") == 0
    for name in ("T1", "T3"):
        assert tier_of(out / name) == name
        assert es.models.load_pretrained(out / name).config.n_channels > 0    # loads: weights match config.json
    assert not (out / "T1" / "tokenizer.json").exists()
    assert sorted(p.name for p in out.iterdir()) == [".lock", "T1", "T3"]   # no staging folder left behind
    from elastic_ssm.utils.files import process_umask

    assert (out / "T1").stat().st_mode & 0o777 == 0o777 & ~process_umask()   # as mkdir makes it, not mkdtemp's 0700


def test_export_overwrite_keeps_the_old_folder_when_the_check_fails(model_dir, tmp_path, capsys, monkeypatch):
    import elastic_ssm.models as export_mod

    out = tmp_path / "exp"
    (out / "T1").mkdir(parents=True)
    (out / "T1" / "model.safetensors").write_bytes(b"old")
    real = export_mod.check_export

    def failing(*a, **kw):
        res = real(*a, **kw)
        res.params_actual += 1                       # a standalone model of the wrong size: the check fails
        return res

    monkeypatch.setattr(export_mod, "check_export", failing)
    assert export(model_dir, out, "--tiers", "T1", "--overwrite") == 1
    assert "keeps its old files" in capsys.readouterr().out
    assert (out / "T1" / "model.safetensors").read_bytes() == b"old"


def test_export_refuses_a_file_where_a_tier_folder_belongs(model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    out.mkdir()
    (out / "T1").write_text("a file")
    assert export(model_dir, out, "--tiers", "T1", "--overwrite") == 2
    assert "is a file" in one_error_line(capsys)
    assert (out / "T1").read_text() == "a file"


# ---- 2. tokenizer train / prepare never replace an existing output without --overwrite ---------------------------
@pytest.fixture
def corpus(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello elastic world, the quick brown fox\n" * 200)
    return text


def test_tokenizer_train_refuses_an_existing_out(corpus, tmp_path, capsys):
    out = tmp_path / "tokenizer.json"
    out.write_text('{"model": {"type": "a model\'s tokenizer"}}')
    args = ["tokenizer", "train", str(corpus), "--vocab_size", "300", "--out", str(out)]
    assert main(args) == 2
    line = one_error_line(capsys)
    assert f"--out {out} already exists" in line and "--overwrite" in line
    assert out.read_text() == '{"model": {"type": "a model\'s tokenizer"}}'
    assert main([*args, "--overwrite"]) == 0
    assert json.loads(out.read_text())["model"]["type"] == "BPE"


def test_prepare_refuses_an_existing_token_file_or_sidecar(corpus, tmp_path, capsys):
    out = tmp_path / "t.bin"
    assert main(["prepare", str(corpus), str(out)]) == 0
    tokens, sidecar = out.read_bytes(), (tmp_path / "t.bin.json").read_text()
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text("different text\n" * 10)
    assert main(["prepare", str(other), str(out)]) == 2
    line = one_error_line(capsys)
    assert f"OUT {out} already exists" in line and "--overwrite" in line
    assert out.read_bytes() == tokens and (tmp_path / "t.bin.json").read_text() == sidecar
    out.unlink()                                  # a sidecar alone is output too: it would be replaced
    assert main(["prepare", str(other), str(out)]) == 2
    assert "t.bin.json already exists" in one_error_line(capsys)
    assert (tmp_path / "t.bin.json").read_text() == sidecar
    assert main(["prepare", str(other), str(out), "--overwrite"]) == 0
    assert out.stat().st_size == 2 * len(other.read_bytes()) + 2    # uint16 bytes + one SEP
    assert json.loads((tmp_path / "t.bin.json").read_text())["source"] == str(other)


# ---- 2b. --csv never replaces a saved file: an existing CSV needs --overwrite, a model's file never goes -------------
def eval_csv(model_dir, csv, *flags):
    return main(["eval", str(model_dir), "--seq_len", "16", "--batch_size", "1", "--n_batches", "1",
                 "--no_write_quality", "--csv", str(csv), *flags])


def test_eval_csv_refuses_an_existing_file_and_overwrite_replaces_it(model_dir, tmp_path, capsys):
    csv = tmp_path / "mine.csv"
    csv.write_bytes(b"my own table\r\n")
    assert eval_csv(model_dir, csv) == 2
    line = one_error_line(capsys)
    assert f"--csv {csv} already exists" in line and "--overwrite" in line
    assert csv.read_bytes() == b"my own table\r\n"
    assert eval_csv(model_dir, csv, "--overwrite") == 0
    assert csv.read_text().startswith("tier,")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_csv_never_replaces_a_file_of_the_model_even_with_overwrite(model_dir, name, capsys):
    target = model_dir / name
    before = target.read_bytes()
    assert eval_csv(model_dir, target, "--overwrite") == 2
    line = one_error_line(capsys)
    assert f"--csv {target} already exists and is not a .csv file" in line and "even with --overwrite" in line
    assert target.read_bytes() == before
    assert es.models.load_pretrained(model_dir).config.n_channels > 0       # the model still loads


def test_csv_refuses_a_folder_even_with_overwrite(model_dir, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("kept")
    assert eval_csv(model_dir, tmp_path, "--overwrite") == 2
    assert f"--csv {tmp_path} is a folder" in one_error_line(capsys)
    assert (tmp_path / "keep.txt").read_text() == "kept"


@pytest.mark.parametrize("verb", [["eval"], ["niah"], ["lm-eval", "--tasks", "piqa"]])
def test_csv_refusal_comes_before_the_model_is_loaded(verb, model_dir, tmp_path, capsys, monkeypatch):
    import elastic_ssm.models

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the --csv check")

    monkeypatch.setattr("elastic_ssm.eval.lm_harness.evaluate_tiers_on_tasks", loading)   # imports it first: it
    monkeypatch.setattr(elastic_ssm.models, "load_pretrained", loading)   # binds the real load_pretrained for later
    csv = tmp_path / "mine.csv"
    csv.write_text("mine")
    assert main([verb[0], str(model_dir), *verb[1:], "--csv", str(csv)]) == 2
    assert f"--csv {csv} already exists" in one_error_line(capsys)
    assert csv.read_text() == "mine"


def test_write_csv_applies_the_same_rule_as_the_early_check(tmp_path):
    """A file that appears while a verb runs is refused at the write too (one rule, ``check_replaceable``)."""
    target = tmp_path / "t.csv"
    write_csv(str(target), [{"a": 1}])
    with pytest.raises(ConfigError, match="already exists; pass --overwrite"):
        write_csv(str(target), [{"a": 2}])
    assert target.read_bytes() == b"a\r\n1\r\n"
    write_csv(str(target), [{"a": 2}], overwrite=True)
    assert target.read_bytes() == b"a\r\n2\r\n"
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="not a .csv file"):
        write_csv(str(notes), [{"a": 1}], overwrite=True)
    with pytest.raises(ConfigError, match="is a folder"):
        write_csv(str(tmp_path), [{"a": 1}], overwrite=True)
    assert notes.read_text() == "mine"


# ---- 3. generate: a --prompt that is not UTF-8 -------------------------------------------------------------------
def test_generate_names_a_prompt_that_is_not_utf8(model_dir, capsys):
    prompt = b"def \xff\xfe x".decode("utf-8", "surrogateescape")     # what Python makes of such argv bytes
    assert main(["generate", str(model_dir), "--prompt", prompt, "--max_new_tokens", "2"]) == 2
    line = one_error_line(capsys)
    assert "--prompt is not valid UTF-8 text" in line and "0xff" in line and "iconv" in line
    assert "surrogates" not in line
    assert capsys.readouterr().out == ""                # nothing printed as if it were the prompt


def test_eval_writes_into_the_model_directory_only_when_asked(model_dir, tmp_path, capsys, monkeypatch):
    """Issue 41 item 6: eval wrote tier_quality.json into the directory it was only asked to read, and on a read-only
    directory warned and exited 0. Now: nothing is written there unless --write_quality; asked and not writable is
    one error line (the results were printed before it)."""
    before = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    csv_path = tmp_path / "e.csv"
    args = ["eval", str(model_dir), "--tiers", "T1", "--n_batches", "1", "--batch_size", "1", "--seq_len", "16"]
    assert main([*args, "--csv", str(csv_path)]) == 0
    assert {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()} == before and csv_path.is_file()
    capsys.readouterr()

    import elastic_ssm.serve.select as calibrate

    def read_only(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(calibrate, "write_quality", read_only)
    assert main([*args, "--write_quality"]) == 2
    out, err = capsys.readouterr()
    assert "T1" in out                                   # the results came first
    lines = [line for line in err.splitlines() if "error" in line]      # the device status line is not an error
    assert len(lines) == 1 and "--write_quality" in lines[0] and "Permission denied" in lines[0], lines
    assert "Traceback" not in err
