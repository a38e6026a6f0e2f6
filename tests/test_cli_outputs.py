"""What the writing verbs do with outputs that already exist (export, tokenizer train, prepare, the --csv of eval /
niah / lm-eval), generate's --prompt that is not UTF-8, the one tier-list parser (spaces around names) of
export / generate / eval, and the one tier word (an ES-SSM budget ``8``) of every verb."""

import json

import pytest

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.cli_util import checked_capacities, checked_tiers, tier_names, write_csv
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


# ---- 4. one tier-list parser: spaces around names ----------------------------------------------------------------
def test_tier_names_strips_spaces():
    assert tier_names("T1, T4") == ["T1", "T4"] and tier_names(" T1 ,T4 ") == ["T1", "T4"]
    assert tier_names("all") is None and tier_names(" all ") is None


def test_tier_lists_with_spaces_in_every_verb(model_dir, tmp_path, capsys):
    model = es.models.load_pretrained(model_dir)
    assert checked_tiers(model, "T1, T4") == ["T1", "T4"]
    assert [t.name for t in checked_capacities(model, "T1, T4")] == ["T1", "T4"]    # eval: as before
    assert checked_tiers(model, "T4,T4,full,T10") == ["T4", "T10"]       # a tier given twice is measured once
    assert [t.name for t in checked_capacities(model, "T4, T4,full,T10")] == ["T4", "T10"]
    out = tmp_path / "exp"
    assert export(model_dir, out, "--tiers", "T1, T4") == 0
    assert tier_of(out / "T1") == "T1" and tier_of(out / "T4") == "T4"
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--tier", " T4", "--prompt", "def", "--max_new_tokens", "2",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
    assert main(["generate", str(model_dir), "--tier", "T1, T4", "--prompt", "def"]) == 2
    assert "names several tiers" in one_error_line(capsys)


def test_a_standalone_export_loads_by_the_name_of_the_tier_it_was_cut_from(tmp_path):
    """``exports/T4`` has one tier of its own, named T4 (``tier_names``); ``tier="T4"`` is the whole export with
    its source kept, any other name is refused with the tier it was cut from."""
    import elastic_ssm as es

    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    es.export_tier(model, "T4").save_pretrained(tmp_path / "T4")
    whole = es.ESSH.from_pretrained(tmp_path / "T4")
    named = es.ESSH.from_pretrained(tmp_path / "T4", tier="T4")
    assert named.num_parameters() == whole.num_parameters() == model.num_parameters("T4")
    assert [t.name for t in named.tier_table()] == ["T4"] and named.source == whole.source
    assert named.source["tier"] == "T4" and "parent" not in named.source     # not re-cut from the export itself
    for other in ("T6", "T1"):
        with pytest.raises(ValueError, match="standalone export of tier T4"):
            es.ESSH.from_pretrained(tmp_path / "T4", tier=other)
    with pytest.raises(ValueError, match="unknown tier 'T66'") as err:
        es.ESSH.from_pretrained(_saved_parent(model, tmp_path), tier="T66")
    assert "standalone export" not in str(err.value)


def _saved_parent(model, tmp_path):
    model.save_pretrained(tmp_path / "full")
    return tmp_path / "full"


def test_full_names_the_full_tier_in_every_tier_list(model_dir, tmp_path, capsys):
    """``full`` (what generate's --tier and the tier errors offer) works in export's and eval's --tiers too."""
    assert checked_tiers(es.ESSH.from_pretrained(model_dir), "T1, Full") == ["T1", "T10"]
    assert export(model_dir, tmp_path / "ex", "--tiers", "full") == 0 and tier_of(tmp_path / "ex" / "T10") == "T10"
    capsys.readouterr()
    assert main(["eval", str(model_dir), "--tiers", "full", "--n_batches", "1", "--batch_size", "1", "--seq_len", "16",
                 "--no_write_quality"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:3]] == ["T10"]


def test_an_export_written_before_tier_names_still_loads_by_either_name(tmp_path):
    """A config.json without ``tier_names`` (exports of earlier versions) calls its tier T1; the source tier's name
    loads it whole too."""
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    es.export_tier(model, "T4").save_pretrained(tmp_path / "T4")
    cfg_file = tmp_path / "T4" / "config.json"
    meta = json.loads(cfg_file.read_text())
    del meta["config"]["tier_names"]
    cfg_file.write_text(json.dumps(meta))
    for name in ("T1", "T4", None):
        loaded = es.ESSH.from_pretrained(tmp_path / "T4", tier=name)
        assert [t.name for t in loaded.tier_table()] == ["T1"] and loaded.source["tier"] == "T4"


def test_an_export_written_before_tier_names_answers_to_both_names_in_every_verb(tmp_path, capsys):
    """``tests/fixtures/legacy_export/T4`` was written by commit ff49162 (``elastic-ssm export final --tiers T4 --out
    exports`` of the tiny ESSH at d_model 16, d_ff 32, head_dim 8, trained 2 steps on a byte corpus). Its one tier
    is T1 and the source tier's name T4 reaches it too: ``eval --tiers T4`` and serve's ``--tiers T4`` refused it
    (only loading by ``tier="T4"`` matched the source's name)."""
    import shutil
    from pathlib import Path

    from elastic_ssm.serve.remote import model_view

    t4 = tmp_path / "T4"
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "legacy_export" / "T4", t4)
    assert "tier_names" not in (t4 / "config.json").read_text()
    for name in ("T4", "T1"):
        assert main(["eval", str(t4), "--tiers", name, "--n_batches", "1", "--batch_size", "1", "--seq_len", "16",
                     "--write_quality"]) == 0
        assert list(json.loads((t4 / "tier_quality.json").read_text())["tiers"]) == ["T1"]
        assert main(["generate", str(t4), "--tier", name, "--prompt", "de", "--max_new_tokens", "2"]) == 0
    served = model_view(t4)
    assert checked_tiers(served, "T4") == checked_tiers(served, "T1") == ["T1"]
    assert es.ESSH.from_pretrained(t4).resolve_tier("T4") == es.ESSH.from_pretrained(t4, tier="T4").resolve_tier()
    capsys.readouterr()
    assert main(["eval", str(t4), "--tiers", "T6", "--n_batches", "1"]) == 2
    assert "unknown tier 'T6'" in one_error_line(capsys)


def test_verbs_call_an_export_by_its_source_tier(model_dir, tmp_path, capsys):
    """export --tiers T4 writes a directory that eval, generate and serve's tier list call T4."""
    from elastic_ssm.serve.remote import model_view

    assert export(model_dir, tmp_path / "ex", "--tiers", "T4") == 0
    t4 = tmp_path / "ex" / "T4"
    capsys.readouterr()
    assert main(["eval", str(t4), "--tiers", "T4", "--n_batches", "1", "--batch_size", "1", "--seq_len", "16",
                 "--write_quality"]) == 0
    assert list(json.loads((t4 / "tier_quality.json").read_text())["tiers"]) == ["T4"]
    assert main(["generate", str(t4), "--tier", "T4", "--prompt", "de", "--max_new_tokens", "2",
                 "--temperature", "0"]) == 0
    capsys.readouterr()
    assert main(["generate", str(t4), "--tier", "T1", "--prompt", "de"]) == 2
    assert "standalone export of tier T4" in one_error_line(capsys)
    served = model_view(t4)                      # what serve lists (ids NAME@T4) and resolves --tier with
    assert [t.name for t in served.tier_table()] == ["T4"] and checked_tiers(served, "T4") == ["T4"]


# ---- 5. one tier word: an all-digit word is an ES-SSM budget in every verb ---------------------------------------
def test_tier_word_makes_digits_a_budget_and_keeps_every_other_word():
    from elastic_ssm.config import tier_word

    assert tier_word("8") == 8 and tier_word(" 12 ") == 12
    assert [tier_word(w) for w in ("K8", "T4", " T4", "0.5", "-1", "all", "²")] == ["K8", "T4", "T4", "0.5", "-1",
                                                                                   "all", "²"]


@pytest.fixture(scope="module")
def es_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("es") / "m"
    es.ESSSM(es.ESSSMConfig.preset("tiny")).save_pretrained(path)   # K-bar 8, budgets (2, 4, 8)
    return path


def test_es_ssm_budgets_are_accepted_by_every_verb(es_dir, tmp_path, capsys):
    """``8`` is ``K8`` wherever a tier is named: the shared list parser (export, niah, serve, calibrate, recover),
    eval's capacities, generate, --train.eval.tiers and --model.tier_config (a specialist and its matching)."""
    from elastic_ssm.config import model_config_from_dict
    from elastic_ssm.elastic.tiers import parameter_report
    from elastic_ssm.train.metrics import eval_tier_list

    model = es.models.load_pretrained(es_dir)
    assert checked_tiers(model, "8, K4,2") == ["K8", "K4", "K2"]
    assert [t.name for t in checked_capacities(model, "4,K8, 3")] == ["K4", "K8", "K3"]
    assert [t.name for t in eval_tier_list(model, ("4", "K8"))] == ["K4", "K8"]
    assert export(es_dir, tmp_path / "ex", "--tiers", "8,K2") == 0
    assert tier_of(tmp_path / "ex" / "K8") == "K8" and tier_of(tmp_path / "ex" / "K2") == "K2"
    capsys.readouterr()
    assert main(["generate", str(es_dir), "--tier", "4", "--prompt", "ab", "--max_new_tokens", "2",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    source = {"arch": "es_ssm", "preset": "tiny", "tier_config": "4"}
    assert model_config_from_dict(source) == model_config_from_dict({**source, "tier_config": "K4"})
    assert model_config_from_dict(source).n_channels == 4
    reference = parameter_report(model_config_from_dict(source), source)["reference"]
    assert reference["model"] == "K4 of es_ssm tiny" and reference["holds"]


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
