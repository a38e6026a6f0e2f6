"""A run saved by an older elastic_ssm resumes with this one (``tests/fixtures/legacy_run``).

The fixture was written by commit ff49162, before configs had ``tier_names``: ``elastic-ssm train --config
run.yaml --train.out_dir run --stop-after 1`` (the tiny ESSH preset at d_model 16, d_ff 32, head_dim 8; a byte
corpus of 9.9 kB), stopped after step 1 of 2. ``expected.json`` holds what that commit logged at step 2 when the
same run was not interrupted. Settings added since (``ModelConfig.added_fields``) must keep such a run resumable:
the seventeenth session's device calls found that they did not (claim 3's MQAR checkpoints were refused twice).
"""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from elastic_ssm.cli import main
from elastic_ssm.models import load_pretrained

LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_run"


def _metrics(run: Path, step: int) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train" and r["step"] == step]
    evals = {r["tier"]: r["loss"] for r in rows if r["kind"] == "eval" and r["step"] == step}
    assert len(train) == 1, rows
    return train[0], evals


def _resume_as_uninterrupted(fixture: Path, tmp_path: Path, monkeypatch):
    """Copy ``fixture`` (an old run stopped after step 1 of 2), resume it with this version's ``elastic-ssm
    train --resume``, check that step 2 logs what the old commit's uninterrupted run logged (``expected.json``),
    and return the run's final model."""
    work = tmp_path / fixture.name
    shutil.copytree(fixture, work)
    assert "tier_names" not in (work / "run" / "run.yaml").read_text()
    monkeypatch.chdir(work)                       # run.yaml names its corpus relative to the run's folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", "run.yaml", "--train.out_dir", "run", "--resume"]) == 0
    want = json.loads((work / "expected.json").read_text())["uninterrupted_step_2"]
    train, evals = _metrics(work / "run", 2)
    assert train["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert train["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert evals == pytest.approx(want["eval_loss"], rel=1e-6)
    return load_pretrained(work / "run" / "final")


def test_a_run_saved_before_tier_names_resumes_and_continues_as_it_would_have(tmp_path, monkeypatch):
    final = _resume_as_uninterrupted(LEGACY, tmp_path, monkeypatch)
    assert [t.name for t in final.config.tier_table()] == [f"T{i}" for i in range(1, 11)]


SPECIALIST = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_specialist"


def test_a_specialist_saved_before_tier_names_resumes_under_its_old_name(tmp_path, monkeypatch):
    """``tests/fixtures/legacy_specialist`` was written by commit ff49162: ``elastic-ssm train --config run.yaml
    --train.out_dir run --stop-after 1``, a specialist of the tiny ESSH's T4 (``model.tier_config: T4``; d_model 16,
    d_ff 32, head_dim 8) stopped after step 1 of 2; ``expected.json`` is what the uninterrupted run logged at step 2.
    Today a specialist of T4 is named T4 (``tier_names``); the old run named its one tier T1, and its resume was
    refused (``model.tier_names: [] -> ['T4']``). It keeps its old name and continues as it would have."""
    final = _resume_as_uninterrupted(SPECIALIST, tmp_path, monkeypatch)
    assert [t.name for t in final.tier_table()] == ["T1"]


def test_the_python_api_resumes_an_old_specialist_under_its_new_name(tmp_path, monkeypatch):
    """``train(model, ..., resume=True)`` with a specialist built today (named T4) continues the same fixture:
    a tier's name changes no weight and no loss (``ModelConfig.RESUME_FREE``), so neither the run.yaml nor the
    checkpoint's model_config comparison refuses it (both refused it as 'tier_names' differing), and step 2 is
    the uninterrupted run's."""
    from elastic_ssm.config import RunConfig
    from elastic_ssm.pipeline import build_data, fit_model_to_tokenizer, train_run

    work = tmp_path / SPECIALIST.name
    shutil.copytree(SPECIALIST, work)
    monkeypatch.chdir(work)
    run = RunConfig.from_yaml("run.yaml")
    run = fit_model_to_tokenizer(run.replace(train=run.train.replace(out_dir="run")))   # eos / pad of bytes
    assert list(run.model.tier_names) == ["T4"]            # today's name; the saved run has none
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = train_run(run, build_data(run), resume=True, progress=False)
    want = json.loads((work / "expected.json").read_text())["uninterrupted_step_2"]
    train, evals = _metrics(work / "run", 2)
    assert train["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert [t.name for t in model.tier_table()] == ["T4"]
