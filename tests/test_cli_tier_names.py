"""The tier words of every verb: the one tier-list parser (spaces around names) of export / generate / eval, an
export called by the tier it was cut from (and one written before ``tier_names`` by either name), ``full``, and the
one tier word (an ES-SSM budget ``8``) of every verb."""

import json

import pytest
from test_cli_outputs import export, one_error_line, tier_of

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.cli_util import checked_capacities, checked_tiers, tier_names


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(path)
    return path


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
