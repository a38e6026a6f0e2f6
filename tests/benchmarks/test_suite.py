"""Bench suites (``benchmarks/suite.py``, ``configs/bench/*.yaml``, ``elastic-ssm bench --bench.suite``): every
suite file loads into typed entries, targets as data, the time budget, required entries, overrides and entry
selection, one-line errors, and the CPU suite end to end through the CLI."""

import json
from pathlib import Path

import pytest

import elastic_ssm as es
from benchmarks.kinds import KINDS, kind_options
from benchmarks.suite import apply_overrides, load_suite, run_suite
from benchmarks.targets import evaluate_targets, parse_targets
from elastic_ssm.cli import main as cli_main

SUITES = sorted((Path(__file__).resolve().parents[2] / "configs" / "bench").glob("*.yaml"))


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_every_suite_file_loads_into_typed_entries(path):
    suite = load_suite(path)
    assert suite.name == path.stem and suite.entries and suite.description
    for e in suite.entries:
        assert isinstance(e.options, kind_options(e.kind)), (e.name, e.kind)
        assert all(t.metric for t in e.targets)


def test_suites_cover_the_folded_scripts():
    kinds = {e.kind for p in SUITES for e in load_suite(p).entries}
    assert kinds == set(KINDS)                      # every entry kind is used by some suite
    gen = {e.name: e for e in load_suite("generate").entries}
    assert {"gpu-tests", "generate-370m", "generate-1.5b", "compiled-prefill-1.5b", "first-token"} <= set(gen)
    assert gen["generate-1.5b"].options.generate_batches == (1, 128)
    assert gen["gpu-tests"].env == {"ELASTIC_SSM_SCAN_BACKEND": "torch"}
    train = {e.name: e for e in load_suite("train-2gpu").entries}
    assert load_suite("train-2gpu").gpus == 2 and train["combos"].options.precisions == ("fp32", "bf16")


def test_targets_evaluate_to_pass_fail_and_na():
    rows = [{"tier": "T10", "batch": 1, "ms_per_token": 0.55}, {"tier": "T10", "batch": 128, "ms_per_token": 5.0},
            {"tier": "T1", "batch": 1, "error": "OOM"}, {"tier": "T4", "batch": 1, "match": True}]
    targets = parse_targets([{"where": {"tier": "T10"}, "ms_per_token": {"max": 1.25}},
                             {"where": {"tier": "T10", "batch": 128}, "ms_per_token": {"min": 4.0, "max": 4.5}},
                             {"where": {"tier": "T1"}, "ms_per_token": {"max": 1.0}},
                             {"match": {"equals": True}, "name": "formula"}], "test")
    res = evaluate_targets(targets, rows, "e")
    assert [(r["target"], r["value"], r["status"]) for r in res] == [
        ("ms_per_token <= 1.25 (tier=T10)", 0.55, "PASS"), ("ms_per_token <= 1.25 (tier=T10)", 5.0, "FAIL"),
        ("ms_per_token <= 4.5 and ms_per_token >= 4 (tier=T10, batch=128)", 5.0, "FAIL"),
        ("ms_per_token <= 1 (tier=T1)", None, "n/a"), ("formula", True, "PASS")]
    assert res[3]["why"] == "row error: OOM" and res[0]["row"] == "batch=1"
    assert [r.get("target") for r in rows] == ["PASS", "FAIL", None, "PASS"]
    skipped = evaluate_targets(targets[:1], [], "e", state="skipped: time budget")
    assert skipped[0]["status"] == "n/a" and skipped[0]["why"] == "skipped: time budget"


def _suite(tmp_path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_time_budget_skips_the_entries_that_would_start_after_it(tmp_path):
    path = _suite(tmp_path, """
description: budget
budget_s: 0.3
entries:
  - {name: slow, kind: command, args: [python, -c, "import time; time.sleep(0.6)"], target: {rc: {equals: 0}}}
  - {name: late, kind: command, args: [python, -c, "print(1)"], target: {rc: {equals: 0}}}
""")
    res = run_suite(load_suite(path), out_dir=tmp_path / "out", log=lambda s: None)
    states = {e["name"]: e["state"] for e in res["entries"]}
    assert states == {"slow": "ran", "late": "skipped: time budget"} and res["skipped"] == ["late"]
    assert [(t["entry"], t["status"]) for t in res["targets"]] == [("slow", "PASS"), ("late", "n/a")]
    saved = json.loads((tmp_path / "out" / "s.json").read_text())
    assert saved["skipped"] == ["late"] and "late" in (tmp_path / "out" / "s.md").read_text()
    res = run_suite(load_suite(path), out_dir=tmp_path / "out2", budget_s=0, log=lambda s: None)   # 0: no limit
    assert [e["state"] for e in res["entries"]] == ["ran", "ran"]


def test_a_failed_required_entry_skips_the_rest_and_the_cli_says_so(tmp_path, capsys):
    """A replication suite's restore is ``required``: training on without the carried state would pack a new state
    that replaces it. A failing ordinary entry lets the rest run; a failing required one stops the suite."""
    text = """
entries:
  - {name: soft, kind: command, args: [python, -c, "raise SystemExit(3)"]}
  - {name: hard, kind: replication_state, action: restore, carry: CARRY, root: ROOT, required: true}
  - {name: after, kind: command, args: [python, -c, "open('AFTER', 'w')"]}
"""
    for word, where in (("CARRY", "carry"), ("ROOT", "root"), ("AFTER", "x")):
        text = text.replace(word, str(tmp_path / where))
    path = _suite(tmp_path, text)
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "replication-state.json").write_text("garbage{")
    res = run_suite(load_suite(path), out_dir=tmp_path / "out", log=lambda s: None)
    states = {e["name"]: e["state"] for e in res["entries"]}
    assert states["soft"] == "ran" and states["after"] == "skipped: required entry hard failed"
    assert states["hard"].startswith("error: ConfigError: carried state") and "not a state written by pack" in states[
        "hard"]
    assert res["stopped_by"]["entry"] == "hard" and res["skipped"] == ["after"]
    assert not (tmp_path / "x").exists()
    assert cli_main(["bench", "--bench.suite", str(path), "--bench.out_dir", str(tmp_path / "out3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped: its required entry hard failed" in err[0], err
    path = _suite(tmp_path, text.replace(", required: true", ""))     # not required: the rest runs, rc says it
    assert cli_main(["bench", "--bench.suite", str(path), "--bench.out_dir", str(tmp_path / "out4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 3 entries failed, first hard" in err[0], err
    assert (tmp_path / "x").exists()
    with pytest.raises(Exception, match="required must be true or false"):
        load_suite(_suite(tmp_path, "entries:\n  - {name: a, kind: bench, required: yes please}"))


def test_overrides_and_entry_selection(tmp_path):
    suite = apply_overrides(load_suite("train-2gpu"), ("combos.steps=4", "timeout_s=99"), {"nproc": 3})
    e = {x.name: x.options for x in suite.entries}
    assert e["combos"].steps == 4 and e["scaling"].steps == 12              # ENTRY.KEY sets one entry
    assert e["combos"].timeout_s == e["scaling"].timeout_s == e["ddp-check"].timeout_s == 99
    assert e["combos"].nproc == e["scaling"].nproc == 3
    with pytest.raises(es.ConfigError, match="no entry of suite train-2gpu has an option 'stepz'"):
        apply_overrides(load_suite("train-2gpu"), ("stepz=4",))
    with pytest.raises(es.ConfigError, match="nproc must be >= 2"):
        apply_overrides(load_suite("train-2gpu"), ("scaling.nproc=1",))


def test_pytest_entry_counts_the_outcomes(tmp_path):
    from benchmarks.suite import EntryContext
    from benchmarks.tests_kind import PytestOptions, run_tests

    (tmp_path / "test_x.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    assert 0\n")
    ctx = EntryContext(name="t", out_dir=tmp_path / "out", log=lambda s: None)
    (row,) = run_tests(PytestOptions(args=("-q", str(tmp_path / "test_x.py"))), ctx)
    assert (row["passed"], row["failed"], row["rc"]) == (1, 1, 1)
    assert "test_b" in (tmp_path / "out" / "pytest.log").read_text()


def test_cpu_suite_runs_end_to_end_through_the_cli(tmp_path, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nearlier numbers\n")
    rc = cli_main(["bench", "--bench.suite", "cpu-smoke", "--bench.only", "memory", "decode", "--bench.iters", "2",
                   "--bench.out_dir", str(tmp_path / "out"), "--bench.docs", str(docs)])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "cpu-smoke.json").read_text())
    assert [e["name"] for e in res["entries"]] == ["memory", "decode"]
    assert res["entries"][1]["options"]["iters"] == 2 and res["entries"][1]["options"]["device"] == "cpu"
    mem = [t for t in res["targets"] if t["entry"] == "memory"]
    assert len(mem) == 10 and all(t["status"] == "PASS" for t in mem)       # every tier's state == formula
    dec = [t for t in res["targets"] if t["entry"] == "decode"]
    assert len(dec) == 1 and dec[0]["status"] in ("PASS", "FAIL") and dec[0]["value"] > 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nearlier numbers\n") and "suite `cpu-smoke`" in text and "PASS" in text
    assert "## targets" in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [
    ("entries: []", "'entries' must be a non-empty list"),
    ("entries:\n  - {name: a, kind: speed}", "unknown kind 'speed'"),
    ("entries:\n  - {name: a, kind: bench, presett: tiny}", "unknown field(s) ['presett']"),
    ("entries:\n  - {name: a, kind: bench, benchmarks: [speed]}", "BenchConfig.benchmarks[0]: Input should be"),
    ("entries:\n  - {name: a, kind: bench, target: {ms: 1.2}}", "target metric 'ms' needs a mapping"),
    ("entries:\n  - {name: a, kind: bench}\n  - {name: a, kind: bench}", "two entries are named 'a'"),
    ("budget: 3\nentries:\n  - {name: a, kind: bench}", "unknown key(s) ['budget']"),
    ("entries: [ {name: a", "invalid YAML at line"),
    ("entries:\n  - {name: a, kind: bench}\nentries: []", "key 'entries' is given twice (lines 1 and 3)"),
])
def test_bad_suite_files_give_one_line_errors(tmp_path, capsys, text, message):
    rc = cli_main(["bench", "--bench.suite", str(_suite(tmp_path, text))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def test_unknown_suite_and_selection_errors_name_the_choices(capsys):
    assert cli_main(["bench", "--bench.suite", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench suite 'nosuch'" in err and "'generate'" in err and "'train-2gpu'" in err
    assert cli_main(["bench", "--bench.suite", "cpu-smoke", "--bench.only", "nothing*"]) == 2
    assert "matches no entry of suite cpu-smoke" in capsys.readouterr().err


def test_run_log_keeps_every_line(tmp_path, capsys):
    from benchmarks.suite import RunLog

    log = RunLog(tmp_path / "sub" / "run.log")
    log("first")
    log("second")
    lines = (tmp_path / "sub" / "run.log").read_text().splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines] == ["first", "second"]
    assert "second" in capsys.readouterr().out


def test_only_takes_commas_and_a_repeated_set_adds_up(tmp_path):
    """``--bench.only a,b`` picks both entries (as ``--bench.only a b`` does), and two ``--bench.set`` flags both
    apply (the second used to replace the first without a word)."""
    path = _suite(tmp_path, """
entries:
  - {name: a, kind: command, args: [python, -c, "import sys; sys.exit(3)"], target: {rc: {equals: 0}}}
  - {name: b, kind: command, args: [python, -c, "import sys; sys.exit(4)"], target: {rc: {equals: 0}}}
  - {name: c, kind: command, args: [python, -c, "import sys; sys.exit(5)"], target: {rc: {equals: 0}}}
""")
    out = tmp_path / "out"
    rc = cli_main(["bench", "--bench.suite", str(path), "--bench.only", "a,b", "--bench.out_dir", str(out),
                   "--bench.set", "a.args=[python,-c,'print(1)']", "--bench.set", "b.args=[python,-c,'print(2)']"])
    res = json.loads((out / "s.json").read_text())
    assert [e["name"] for e in res["entries"]] == ["a", "b"]
    assert [(t["entry"], t["status"]) for t in res["targets"]] == [("a", "PASS"), ("b", "PASS")] and rc == 0


def test_a_command_streams_its_output_and_keeps_it_when_stopped(tmp_path):
    """scan's theta-precision of 2026-12-04 was cut from outside after 200 s and left an empty log: the output
    of a command entry is written (and logged) line by line as it comes, and a timeout kills it."""
    import time

    from benchmarks.kinds import CommandOptions, run_command
    from benchmarks.suite import EntryContext

    seen: list[str] = []
    ctx = EntryContext(name="c", out_dir=tmp_path, log=seen.append, deadline=time.monotonic() + 60)
    code = "import time; print('first result', flush=True); time.sleep(30)"
    t = time.monotonic()
    row = run_command(CommandOptions(args=("python", "-c", code), timeout_s=3), ctx)[0]
    assert row["rc"] == "timeout" and time.monotonic() - t < 15
    assert row["last_line"] == "first result" and "  | first result" in seen
    assert "first result" in (tmp_path / "command.log").read_text()
