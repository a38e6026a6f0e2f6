"""Progress bars of the long verbs (issue 41 item 5): on stderr when forced on (``ELASTIC_SSM_PROGRESS=always``
stands in for a terminal), gone with ``--quiet``, and the results on stdout byte-identical either way; the library
functions are silent unless asked."""

import re

import pytest

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.utils.progress import progress


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(path)
    return path


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("ELASTIC_SSM_PROGRESS", "always")


def run_twice(capsys, argv, bar: str, mask=lambda s: s):
    """Run ``argv`` with bars and with --quiet; the bar's text shows only in the first stderr, stdout is equal."""
    assert main(argv) == 0
    loud = capsys.readouterr()
    assert main([*argv, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert bar in loud.err, loud.err
    assert bar not in quiet.err and "\r" not in quiet.err, quiet.err
    assert loud.out and mask(loud.out) == mask(quiet.out)
    return loud


def test_eval_bar(model_dir, capsys, forced):
    run_twice(capsys, ["eval", str(model_dir), "--seq_len", "16", "--batch_size", "1", "--n_batches", "2",
                       "--tiers", "T1,T4"], "eval L=16")


def test_export_bar(model_dir, tmp_path, capsys, forced):
    run_twice(capsys, ["export", str(model_dir), "--out", str(tmp_path / "x"), "--check_len", "8", "--tiers",
                       "T1,T4", "--overwrite"], "export + check")


def test_niah_bar(model_dir, capsys, forced):
    run_twice(capsys, ["niah", str(model_dir), "--context_len", "160", "--n_pairs", "2", "--depths", "0.5",
                       "--tiers", "T1,T4"], "trial")


def test_importance_bar(model_dir, tmp_path, capsys, forced):
    run_twice(capsys, ["importance", str(model_dir), "--seq_len", "16", "--batch_size", "1", "--n_batches", "1",
                       "--out", str(tmp_path / "imp"), "--overwrite"], "knock-out")


def test_prepare_bar(tmp_path, capsys, forced):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text to tokenize\n" * 50)
    run_twice(capsys, ["prepare", str(corpus), str(tmp_path / "t.bin"), "--overwrite"], "prepare t.bin")


def test_calibrate_bar(tmp_path, capsys, forced):
    d = tmp_path / "m"
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(d)
    run_twice(capsys, ["calibrate", str(d), "--tiers", "T1", "--batches", "1", "--warmup", "0", "--iters", "1"],
              "entry", mask=lambda s: re.sub(r"[\d.]+ ms/token", "ms/token", s))


def test_bars_stay_off_without_a_terminal(model_dir, capsys, monkeypatch):
    monkeypatch.delenv("ELASTIC_SSM_PROGRESS", raising=False)
    assert main(["eval", str(model_dir), "--seq_len", "16", "--batch_size", "1", "--n_batches", "1",
                 "--tiers", "T1"]) == 0
    assert "eval L=16" not in capsys.readouterr().err      # stderr is captured, not a terminal


def test_library_is_silent_unless_asked(capsys, forced):
    list(progress(range(3), desc="hidden"))
    list(progress(range(3), desc="shown", enabled=True))
    err = capsys.readouterr().err
    assert "hidden" not in err and "shown" in err


TINY_RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: 2, micro_batch_size: 2, grad_accum: 1, seq_len: 16,
        mixing: {n_warm_tokens: 16}, eval: {every: 0, batches: 1}, checkpoint: {every: 0}, log_every: 1,
        refine: {steps: 1, tokens_per_step: 32}}
data: {source: stdlib, tokenizer: bytes, max_train_bytes: 20000}
"""
STEP_BAR = re.compile(r"\d+/\d+ \[")        # tqdm's "n/total [elapsed" of the training bar


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(TINY_RUN)
    return path


def test_train_bar_and_quiet(run_file, tmp_path, capsys, forced):
    base = ["train", "--config", str(run_file), "--train.steps", "2"]
    assert main([*base, "--train.out_dir", str(tmp_path / "a")]) == 0
    loud = capsys.readouterr()
    assert STEP_BAR.search(loud.err) and "pretrain" in loud.err, loud.err
    assert main([*base, "--train.out_dir", str(tmp_path / "b"), "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert not STEP_BAR.search(quiet.err) and "\r" not in quiet.err, quiet.err
    assert quiet.out.count("\n") == loud.out.count("\n") and "val loss" in quiet.out     # the status lines stay


def test_train_bar_stays_off_without_a_terminal(run_file, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ELASTIC_SSM_PROGRESS", raising=False)
    assert main(["train", "--config", str(run_file), "--train.out_dir", str(tmp_path / "a")]) == 0
    assert not STEP_BAR.search(capsys.readouterr().err)


def test_recover_bar_and_quiet(model_dir, run_file, tmp_path, capsys, forced):
    base = ["recover", str(model_dir), "--config", str(run_file), "--steps", "1", "--tiers", "T1"]
    assert main([*base, "--train.out_dir", str(tmp_path / "a")]) == 0
    assert STEP_BAR.search(capsys.readouterr().err)
    assert main([*base, "--train.out_dir", str(tmp_path / "b"), "--quiet"]) == 0
    assert not STEP_BAR.search(capsys.readouterr().err)


def test_recover_writes_its_run_record(model_dir, run_file, tmp_path, capsys):
    """``recover`` leaves a ``run.yaml`` as ``train`` does: the settings it ran with (its refine length, seed) and the
    directory its weights came from, so its records need no hand-written record."""
    import yaml

    out = tmp_path / "rec"
    assert main(["recover", str(model_dir), "--config", str(run_file), "--steps", "1", "--tiers", "T1",
                 "--train.seed", "3", "--train.out_dir", str(out), "--quiet"]) == 0
    rec = yaml.safe_load((out / "run.yaml").read_text())
    assert rec["recover"] == {"source": str(model_dir), "protocol": "refine"}
    assert rec["train"]["refine"]["steps"] == 1 and rec["train"]["seed"] == 3 and rec["model"]["arch"] == "essh"
    assert rec["train"]["out_dir"] == str(out)


def test_quickstart_passes_quiet_to_its_training(monkeypatch, tmp_path):
    import elastic_ssm.quickstart as qs

    seen = []
    monkeypatch.setattr(qs, "quickstart", lambda **kw: seen.append(kw["progress"]) or {})
    for extra, want in (([], True), (["--quiet"], "lines")):
        assert main(["quickstart", "--out", str(tmp_path / "q"), *extra]) == 0
        assert seen.pop() == want


@pytest.mark.parametrize("extra,env,want", [([], "always", True), (["--quiet"], "always", False), ([], None, False)])
def test_tokenizer_train_bar_follows_quiet_and_the_terminal(tmp_path, monkeypatch, extra, env, want):
    """The Rust trainer draws its own bar: it gets ``show_progress`` from the same decision (``progress.shown``);
    without ELASTIC_SSM_PROGRESS the captured stderr is no terminal, so the bar is off."""
    import elastic_ssm as es

    if env:
        monkeypatch.setenv("ELASTIC_SSM_PROGRESS", env)
    else:
        monkeypatch.delenv("ELASTIC_SSM_PROGRESS", raising=False)
    seen = []
    real = es.data.train_bpe
    monkeypatch.setattr(es.data, "train_bpe", lambda *a, **kw: seen.append(kw["show_progress"]) or real(*a, **kw))
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello elastic world\n" * 100)
    assert main(["tokenizer", "train", str(corpus), "--vocab_size", "280", "--out", str(tmp_path / "t.json"),
                 *extra]) == 0
    assert seen == [want]
