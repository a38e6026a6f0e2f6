"""Nothing a user saved is lost: a damaged checkpoint is moved aside (never deleted) on --resume, a folder
with files a run would overwrite is refused, quickstart refuses its existing outputs, and a --stop_after
behind the run says that nothing was trained."""

import shutil
import warnings

import harness
import pytest

from elastic_ssm.cli import main
from elastic_ssm.config import ConfigError


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """An unfinished run (6 steps, stopped after step 3; checkpoints step 2 and 3 kept) and its run file."""
    cfg, run = harness.trained_run(tmp_path_factory.mktemp("cut"), 6, "--stop_after", "3")
    assert sorted(p.name for p in (run / "pretrain").glob("step_*")) == ["step_0000002", "step_0000003"]
    return cfg, run


def _copy(cut, tmp_path):
    cfg, run = cut
    shutil.copytree(run, tmp_path / "run")
    return cfg, tmp_path / "run"


def _snapshot(path):
    """Every file under ``path`` and its bytes (a refused start removes the lock file it created)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _train(cfg, out, *extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(["train", "--config", str(cfg), "--train.out_dir", str(out), *extra])


def _one_line_error(capsys, *needles):
    text = capsys.readouterr().err
    lines = [line for line in text.splitlines() if line.strip() and "step/s" not in line and "?step" not in line]
    assert len(lines) == 1 and lines[0].startswith("elastic-ssm") and "Traceback" not in text, text
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _append(path):
    with open(path, "ab") as f:
        f.write(b"# note\n")


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("name,damage", [("train_config.yaml", _append), ("optimizer.pt", _truncate),
                                         ("rank0.pt", _truncate), ("model/model.safetensors", _truncate)])
def test_a_damaged_checkpoint_is_moved_aside_and_the_run_resumes_from_the_previous_one(cut, tmp_path, capsys,
                                                                                       name, damage):
    cfg, run = _copy(cut, tmp_path)
    damage(run / "pretrain" / "step_0000003" / name)
    kept = _snapshot(run / "pretrain" / "step_0000003")
    assert _train(cfg, run, "--resume", "--stop_after", "4") == 0
    out = capsys.readouterr().out
    moved = list((run / "damaged" / "pretrain").glob("step_0000003.damaged-*"))
    assert len(moved) == 1 and _snapshot(moved[0]) == kept          # every byte of it, COMPLETE.json included
    line = next(line for line in out.splitlines() if "failed its check" in line)
    assert name in line and str(moved[0]) in line and "pretrain/step_0000002" in line, line
    assert (run / "pretrain" / "step_0000004" / "COMPLETE.json").is_file()   # resumed from step 2, trained on
    assert (run / "pretrain" / "latest").read_text() == "step_0000004"


def test_only_damaged_checkpoints_are_named_and_left_alone(cut, tmp_path, capsys):
    """--resume and --resume auto on a run whose checkpoints all fail their check: one line naming the file and
    what to do, no "no checkpoint yet, starting", and the folder untouched."""
    cfg, run = _copy(cut, tmp_path)
    for step in ("step_0000002", "step_0000003"):
        _truncate(run / "pretrain" / step / "optimizer.pt")
    before = _snapshot(run)
    assert _train(cfg, run, "--resume", "auto") == 2
    err = _one_line_error(capsys, "step_0000003", "optimizer.pt", "--overwrite", "restore")
    assert "continue it with --resume" not in err
    assert _snapshot(run) == before
    assert _train(cfg, run, "--resume") == 2
    _one_line_error(capsys, "no complete checkpoint", "optimizer.pt", "--overwrite", "restore")
    assert _snapshot(run) == before


def test_resume_auto_with_damaged_checkpoints_prints_no_fresh_start(cut, tmp_path, capsys):
    cfg, run = _copy(cut, tmp_path)
    for step in ("step_0000002", "step_0000003"):
        _append(run / "pretrain" / step / "train_config.yaml")
    assert _train(cfg, run, "--resume", "auto") == 2
    captured = capsys.readouterr()
    assert "no checkpoint yet" not in captured.out and "fail their check" in captured.err


def test_an_unmarked_checkpoint_newer_than_the_last_good_one_is_moved_not_deleted(cut, tmp_path):
    """Only an unmarked directory older than a complete checkpoint (a prune cut short) is deleted; an unmarked
    newer one is moved aside, and a user's copy with another name is left alone."""
    from elastic_ssm.train.rundir import clean_stale_files

    _, run = _copy(cut, tmp_path)
    stage = run / "pretrain"
    shutil.copytree(stage / "step_0000003", stage / "step_0000003.bak")
    shutil.copytree(stage / "step_0000002", stage / "step_0000001")
    (stage / "step_0000001" / "COMPLETE.json").unlink()            # a prune cut short
    shutil.copytree(stage / "step_0000003", stage / "step_0000009")
    (stage / "step_0000009" / "COMPLETE.json").unlink()            # not something a save or a prune leaves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clean_stale_files(run)
    assert not (stage / "step_0000001").exists()
    assert len(list((run / "damaged" / "pretrain").glob("step_0000009.damaged-*"))) == 1
    assert (stage / "step_0000003.bak" / "COMPLETE.json").is_file() and (stage / "step_0000003").is_dir()


def test_a_folder_in_place_of_the_latest_pointer_is_moved_and_the_run_resumes(cut, tmp_path, capsys):
    """``pretrain/latest`` is a one-line file; a folder there (with a user's file in it) is moved into damaged/,
    named on stdout, and the resumed run writes its pointer again."""
    cfg, run = _copy(cut, tmp_path)
    pointer = run / "pretrain" / "latest"
    pointer.unlink()
    pointer.mkdir()
    (pointer / "notes.txt").write_text("mine")
    assert _train(cfg, run, "--resume", "--stop_after", "4") == 0
    moved = list((run / "damaged" / "pretrain").glob("latest.damaged-*"))
    assert len(moved) == 1 and (moved[0] / "notes.txt").read_text() == "mine"
    assert str(moved[0]) in capsys.readouterr().out
    assert pointer.read_text() == "step_0000004"

def test_a_prune_cut_short_leaves_no_marked_half_checkpoint(cut, tmp_path, monkeypatch):
    """Pruning removes an old checkpoint's COMPLETE.json before its files, so a kill mid-prune can never leave
    a marked, half-deleted directory (which the next start would have to keep as damaged)."""
    import elastic_ssm.train.checkpoint as ckpt

    cfg, run = _copy(cut, tmp_path)
    seen = []
    original = ckpt.shutil.rmtree

    def rmtree(path, *a, **kw):
        seen.append((path.name, (path / "COMPLETE.json").exists()))
        return original(path, *a, **kw)

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    assert _train(cfg, run, "--resume", "--stop_after", "4") == 0
    assert ("step_0000002", False) in seen and not any(marked for _, marked in seen)


def test_train_refuses_a_folder_with_files_it_would_overwrite(cut, tmp_path, capsys):
    cfg, _ = cut
    out = tmp_path / "u"
    out.mkdir()
    (out / "run.yaml").write_text("mine: 1\n")
    (out / "parameters.json").write_text("{}")
    before = _snapshot(out)
    for extra in ((), ("--resume", "auto")):
        assert _train(cfg, out, "--stop_after", "1", *extra) == 2
        _one_line_error(capsys, "run.yaml", "parameters.json", "--overwrite", "--train.out_dir")
        assert _snapshot(out) == before
    assert _train(cfg, out, "--stop_after", "1", "--overwrite") == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("u.replaced-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == before


def test_resume_auto_after_an_attempt_cut_before_its_first_checkpoint_keeps_its_record(cut, tmp_path, capsys):
    """The attempt's own run.yaml and log (no checkpoint) are kept as *.prev-<time> and the run starts over."""
    cfg, run = cut
    out = tmp_path / "again"
    out.mkdir()
    for name in ("run.yaml", "metrics.jsonl"):
        shutil.copy(run / name, out / name)
    (out / "parameters.json").write_text('{"params": 1}\n')    # its parameter report too (a replication run restored
                                                                # from its records, 2026-12-02)
    before = _snapshot(out)
    assert _train(cfg, out, "--resume", "auto", "--stop_after", "1") == 0
    assert "no checkpoint yet, starting" in capsys.readouterr().out
    prev_rec, prev_log = list(out.glob("run.prev-*.yaml")), list(out.glob("metrics.prev-*.jsonl"))
    prev_par = list(out.glob("parameters.prev-*.json"))
    assert len(prev_rec) == len(prev_log) == len(prev_par) == 1
    assert prev_rec[0].read_bytes() == before["run.yaml"] and prev_log[0].read_bytes() == before["metrics.jsonl"]
    assert prev_par[0].read_bytes() == before["parameters.json"]


def test_stop_after_behind_the_run_says_nothing_was_trained(cut, tmp_path, capsys):
    cfg, run = _copy(cut, tmp_path)
    before = sorted(p.name for p in (run / "pretrain").glob("step_*"))
    assert _train(cfg, run, "--resume", "--stop_after", "2") == 0
    out = capsys.readouterr().out
    assert "already past step 2 (at pretrain step 3)" in out and "nothing was trained" in out, out
    assert "stopped at step 2" not in out
    assert sorted(p.name for p in (run / "pretrain").glob("step_*")) == before
    assert _train(cfg, run, "--resume", "--stop_after", "3") == 0
    assert "already at step 3 (at pretrain step 3)" in capsys.readouterr().out
    assert _train(cfg, run, "--resume", "--stop_after", "4") == 0
    assert "stopped at step 4" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["report.md", "tiers.csv", "quality_size.png", "exports", "elastic"])
def test_quickstart_refuses_its_existing_outputs(tmp_path, capsys, name):
    out = tmp_path / "qs"
    out.mkdir()
    target = out / name
    if "." in name:
        target.write_text("mine\n")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine\n")
    before = _snapshot(out)
    assert main(["quickstart", "--out", str(out), "--no_control"]) == 2
    _one_line_error(capsys, name, "--overwrite", "--out")
    assert _snapshot(out) == before


def test_quickstart_overwrite_moves_its_outputs_aside(tmp_path):
    from elastic_ssm.quickstart import _claim_outputs

    out = tmp_path / "qs"
    (out / "exports" / "T1").mkdir(parents=True)
    (out / "exports" / "T1" / "config.json").write_text("{}")
    (out / "report.md").write_text("old report\n")
    before = _snapshot(out)
    with pytest.raises(ConfigError, match="exports, report.md"):
        _claim_outputs(out, control=True, overwrite=False)
    dest = _claim_outputs(out, control=True, overwrite=True)
    assert dest.parent == out and _snapshot(dest) == before
    assert not (out / "report.md").exists() and not (out / "exports").exists()


def test_a_start_refused_after_the_folder_was_made_leaves_no_folder_or_lock(cut, tmp_path, capsys, monkeypatch):
    """A refusal after ``preflight`` made the folder and took its lock (here: not enough free disk) removes both;
    in a folder that already existed, only the lock file it created goes."""
    from elastic_ssm.config import ConfigError
    from elastic_ssm.train import preflight

    def full_disk(*args, **kwargs):
        raise ConfigError("not enough free disk (test)")

    monkeypatch.setattr(preflight, "check_free_disk", full_disk)
    cfg, _ = cut
    fresh = tmp_path / "new" / "run"
    assert _train(cfg, fresh, "--stop_after", "1") == 2 and not fresh.parent.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert _train(cfg, kept, "--stop_after", "1") == 2
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    capsys.readouterr()


def test_the_python_api_resume_auto_names_damaged_checkpoints_first(cut, tmp_path, capsys):
    """``train(resume="auto")`` called directly (not through the CLI's own check) refuses before saying anything
    about a fresh start."""
    import elastic_ssm as es
    from elastic_ssm.config import TrainConfig
    from elastic_ssm.train import train

    cfg, run = _copy(cut, tmp_path)
    for step in ("step_0000002", "step_0000003"):
        _append(run / "pretrain" / step / "train_config.yaml")
    capsys.readouterr()
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(ConfigError, match="fail their check"):
        train(model, [], TrainConfig(steps=6, out_dir=str(run), device="cpu"), resume="auto")
    assert "no checkpoint yet" not in capsys.readouterr().out


def test_a_file_in_place_of_the_newest_checkpoint_is_named_and_moved_before_resuming(cut, tmp_path, capsys):
    """``step_0000003`` replaced by a file: ``--resume`` says so and which checkpoint it resumes from before
    training, and keeps the file under damaged/ (it was passed over without a word, then reported at the save of
    step 3 as a checkpoint that "failed to load")."""
    cfg, run = _copy(cut, tmp_path)
    shutil.rmtree(run / "pretrain" / "step_0000003")
    (run / "pretrain" / "step_0000003").write_text("not a checkpoint\n")
    assert _train(cfg, run, "--resume", "--stop_after", "3") == 0
    out = capsys.readouterr().out
    line = next((line for line in out.splitlines() if "failed its check" in line), out)
    assert "it is a file, not a checkpoint folder" in line and "pretrain/step_0000002" in line, line
    assert "failed to load" not in out
    [moved] = (run / "damaged" / "pretrain").glob("step_0000003.damaged-*")
    assert moved.read_text() == "not a checkpoint\n" and str(moved) in line
    assert (run / "pretrain" / "step_0000003" / "COMPLETE.json").is_file()


def test_stop_after_at_the_last_pretraining_step_stops_before_refinement(tmp_path, capsys):
    """--stop_after N with N = train.steps ended pretraining there and then ran the whole refinement stage and wrote
    final/ ("no final model", says the flag); the call now ends at that checkpoint, and --resume goes on."""
    cfg = harness.write_run(tmp_path, steps=3)
    out = tmp_path / "run"
    assert _train(cfg, out, "--train.refine.steps", "2", "--stop_after", "3") == 0
    assert (out / "pretrain" / "step_0000003").is_dir()
    assert not (out / "refine").exists() and not (out / "final").exists()
    assert "stopped at step 3 of the current stage" in capsys.readouterr().out
    assert _train(cfg, out, "--train.refine.steps", "2", "--resume") == 0
    assert (out / "refine" / "step_0000002").is_dir() and (out / "final").is_dir()
