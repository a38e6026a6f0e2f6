"""The replication reports (issue 16): a claim's JSON lists what is missing and judges smoothness; a run's rate is
its tokens over its seconds (start-up and warm-up steps apart); claims 3 and 5 read the runs' validations and set
each specialist beside the shared tier of its size; a run evaluated by its validation gets its eval.csv."""

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.replication.claims import collect_claim, run_summary
from benchmarks.replication.report import ReplicationReportOptions, run_report
from benchmarks.suite import EntryContext

REPO = Path(__file__).resolve().parents[2]


def _ctx(tmp_path, name="step", budget=None):
    deadline = None if budget is None else time.monotonic() + budget
    return EntryContext(name=name, out_dir=tmp_path / "bench" / name, log=lambda s: None, deadline=deadline)


def test_report_lists_missing_runs_and_judges_smoothness(tmp_path):
    root = tmp_path / "state"
    run = root / "essh"
    run.mkdir(parents=True)
    rows = [("T1", 0.0625, 8, 192, 7e6, 3.0), ("xi=0.3", 0.3, 18, 768, 1.8e7, 2.4), ("T10", 1.0, 32, 2048, 4.1e7, 2.5)]
    (run / "eval.csv").write_text("tier,xi,K,n_ff,params,bpb,loss\n" +
                                  "".join(f"{t},{x},{k},{n},{int(p)},{b},{b * 0.69}\n" for t, x, k, n, p, b in rows))
    (run / "run.yaml").write_text("model: {arch: essh, preset: 40m}\ntrain: {recipe: capacity_mixed, mixing: "
                                  "{capacities: [0.0625, 1.0]}, refine: {capacities: [0.0625]}}\n")
    res = collect_claim(4, root, ["essh", "spec-t1"])
    assert res["missing"] == ["spec-t1"]
    trained = {r["tier"]: r["trained_shape"] for r in res["rows"]}
    assert trained == {"T1": True, "xi=0.3": False, "T10": True}
    assert res["summary"]["monotone"] is False and res["summary"]["largest_rise_between"] == ["xi=0.3", "T10"]
    assert [r["tier"] for r in collect_claim(1, root, ["essh"])["rows"]] == ["T1", "T10"]   # fractions: claim 4
    opts = ReplicationReportOptions(claim=4, root=str(root), runs=("essh",))
    run_report(opts, _ctx(tmp_path, "report"))
    saved = json.loads((root / "results" / "claim4.json").read_text())
    assert saved["summary"]["untrained_points"] == 1
    if "matplotlib" in sys.modules or _has_matplotlib():
        assert (root / "results" / "claim4.png").stat().st_size > 0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_run_rate_is_tokens_over_seconds_when_step_costs_vary(tmp_path):
    """A budget-dropout run: logged steps of 0.5M tok/s (small K) and 0.2M tok/s (full K). The run's rate is its
    tokens over its seconds, not the median of the records (which the calibration of 2026-12-01 took: 5.7 x too
    fast for the ES-SSM); the first record (start-up) is left out."""
    run = tmp_path / "essm-bd"
    run.mkdir()
    rates = [50_000.0, 5e5, 5e5, 5e5, 2e5, 2e5]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "stage": "pretrain", "step": 10 * (i + 1), "tokens": 65536 * 10 * (i + 1),
                    "tokens_per_s": r}) + "\n" for i, r in enumerate(rates)))
    s = run_summary(run)
    seconds = sum(1 / r for r in rates[1:])                  # per token of a step, each record one step
    assert s["tokens_per_s"] == pytest.approx(5 / seconds) and s["tokens_per_s"] == pytest.approx(3.125e5, rel=1e-4)
    assert s["steady_s"] == pytest.approx(65536 * 60 / s["tokens_per_s"])


def test_one_time_warmup_steps_leave_the_steady_rate_and_go_to_startup(tmp_path):
    """The calibration of 2026-12-01: fla autotuned a new shape inside steps 1 and 8 of the ESSH probe (263 s and
    40 s against ~0.4 s), which took its time-weighted rate to 37k tok/s. Such steps (> WARMUP_FACTOR x the median)
    are warm-up: out of the rate, into the start-up; a 2.5 x spread of step costs (capacity mixing) stays in."""
    run = tmp_path / "calib-essh"
    run.mkdir()
    rates = [250.0, 2e5, 1.6e6, 2e5, 2e5, 65536 / 40.0, 8e4, 2e5, 2e5]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "stage": "pretrain", "step": i + 1, "tokens": 65536 * (i + 1),
                    "tokens_per_s": r}) + "\n" for i, r in enumerate(rates)))
    (run / "calls.jsonl").write_text(json.dumps({"step": "calib-essh-train", "fresh": True, "wall_s": 330.0}) + "\n")
    s = run_summary(run)
    steady = [r for i, r in enumerate(rates) if i not in (0, 5)]
    assert s["warmup_steps"] == [1, 6]
    assert s["tokens_per_s"] == pytest.approx(len(steady) / sum(1 / r for r in steady))
    assert s["warmup_s"] == pytest.approx(65536 / 250.0 + 40.0, abs=0.1)
    calib = collect_claim(0, tmp_path, ["calib-essh"])["summary"]["settings"]["calib-essh"]
    assert calib["startup_s"] == pytest.approx(330.0 - 9 * 65536 / s["tokens_per_s"], abs=0.1)
    assert calib["startup_s"] > s["warmup_s"] > 300


def _mqar_run(root, name, validations, steps=20000, model="{arch: essh}"):
    """A recall run folder: run.yaml (model, train.steps) and the validations of its training at the given steps."""
    run = root / name
    run.mkdir(parents=True)
    (run / "run.yaml").write_text(f"model: {model}\ntrain: {{recipe: capacity_mixed, steps: {steps}}}\n")
    lines = [{"kind": "eval", "stage": "pretrain", "step": step, "tier": tier, "K": k, "n_ff": ff, "accuracy": acc}
             for step, acc in validations for tier, k, ff, acc in
             (("T1", 8, 192, acc - 0.02), ("T4", 18, 256, acc - 0.01), ("T10", 32, 512, acc))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_claim3_reads_the_last_validation_and_a_cut_run_stays_missing(tmp_path):
    """MQAR runs span many device calls: each call's report shows the last validation's accuracy with its step,
    and a run counts as done only once it has validated at its last step."""
    _mqar_run(tmp_path, "mqar-hybrid", [(1000, 0.30), (2000, 0.95)], steps=2000)
    _mqar_run(tmp_path, "mqar-mixer", [(1000, 0.02), (5000, 0.03)],
              model=yaml.safe_load((REPO / "configs/replication/mqar-mixer.yaml").read_text())["model"])
    res = collect_claim(3, tmp_path, ["mqar-hybrid", "mqar-mixer"])
    # a cut run has no parameters.json yet: its counts come from run.yaml's model (Table 21: 1.25 / 1.53 / 2.04M)
    assert [round(r["params"] / 1e6, 2) for r in res["rows"] if r["run"] == "mqar-mixer"] == [1.25, 1.53, 2.04]
    assert res["missing"] == ["mqar-mixer"]
    rows = {(r["run"], r["tier"]): r for r in res["rows"]}
    assert rows["mqar-hybrid", "T10"]["accuracy"] == pytest.approx(0.95) and rows["mqar-hybrid", "T1"]["step"] == 2000
    assert rows["mqar-mixer", "T4"]["accuracy"] == pytest.approx(0.02) and rows["mqar-mixer", "T4"]["step"] == 5000
    assert res["summary"]["progress"] == {"mqar-hybrid": {"validated_at": 2000, "of_steps": 2000},
                                          "mqar-mixer": {"validated_at": 5000, "of_steps": 20000}}


def test_claim5_sets_each_specialist_beside_the_shared_tier_of_its_size(tmp_path):
    """Claim 5 matches a specialist to the shared run's tier by parameter count (the dense control's full model is
    the T10 specialist), sums the specialists' training seconds and divides by the shared run's."""
    root = tmp_path / "state"

    def run(name, rows, wall):
        d = root / name
        d.mkdir(parents=True)
        (d / "eval.csv").write_text("tier,xi,K,n_ff,params,bpb,loss\n" +
                                    "".join(f"{t},{x},8,64,{p},{b},0.5\n" for t, x, p, b in rows))
        (d / "calls.jsonl").write_text(json.dumps({"run": name, "step": f"{name}-train", "wall_s": wall,
                                                   "fresh": True}) + "\n")

    run("essh", [("T1", 0.0625, 700, 1.4), ("T4", 0.3125, 1800, 1.2), ("T10", 1.0, 4100, 1.1)], 300.0)
    run("dense", [("T1", 0.0625, 700, 4.9), ("T10", 1.0, 4100, 1.15)], 200.0)
    run("dense-rec", [("T1", 0.0625, 700, 2.9), ("T10", 1.0, 4100, 1.16)], 50.0)
    run("spec-t1", [("T1", 1.0, 700, 1.25)], 100.0)
    res = collect_claim(5, root, ["essh", "dense", "dense-rec", "spec-t1", "spec-t4"])
    summary = res["summary"]
    assert res["missing"] == ["spec-t4"]
    assert summary["specialists_wall_s"] is None               # spec-t4 has not run: no sum is guessed
    assert [(s["tier"], s["specialist"], s["specialist_bpb"], s["shared_bpb"], s["recovered_bpb"])
            for s in summary["at_sizes"]] == [("T1", "spec-t1", 1.25, 1.4, 2.9), ("T10", "dense", 1.15, 1.1, 1.16)]
    run("spec-t4", [("T1", 1.0, 1800, 1.15)], 150.0)
    run("transformer", [("T1", 1.0, 4110, 1.5)], 90.0)       # one size, not a specialist of a tier: no sum, no size
    names = ["essh", "dense", "dense-rec", "spec-t1", "spec-t4", "transformer"]
    summary = collect_claim(5, root, names)["summary"]
    assert summary["specialists_wall_s"] == pytest.approx(450.0) and summary["wall_ratio"] == pytest.approx(1.5)
    assert [s["tier"] for s in summary["at_sizes"]] == ["T1", "T4", "T10"]
    assert summary["runs"]["transformer"]["bpb_full"] == pytest.approx(1.5) and "transformer" not in summary[
        "specialists"]
    if _has_matplotlib():
        from benchmarks.replication.plot import plot_claim
        assert plot_claim(collect_claim(5, root, names), tmp_path / "claim5.png") == ""
        assert plot_claim(collect_claim(1, root, names), tmp_path / "claim1.png") == ""
        assert (tmp_path / "claim5.png").stat().st_size > 0


def test_a_run_evaluated_by_its_validation_gets_its_eval_csv(tmp_path):
    """MQAR's records had no eval.csv (their recall is the training's last validation); the report step writes
    one from it for a run that reached its steps, and never for a cut run or over an existing file."""
    from benchmarks.replication.claims import final_eval_csv, read_csv

    run = tmp_path / "mqar-mixer-s1"
    run.mkdir()
    (run / "run.yaml").write_text("train:\n  seed: 1\n  steps: 2\n")
    lines = [{"kind": "train", "stage": "pretrain", "step": s, "loss": 1.0, "tokens": 8 * s, "tokens_per_s": 10.0}
             for s in (1, 2)]
    lines += [{"kind": "eval", "tier": t, "accuracy": a, "stage": "pretrain", "step": step}
              for step, (t, a) in ((1, ("T1", 0.1)), (2, ("T1", 0.25)), (2, ("T10", 0.75)))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:3]))
    assert final_eval_csv(run) is None                              # cut at step 2 before its validation
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert final_eval_csv(run) == run / "eval.csv"
    assert [(r["tier"], r["accuracy"], r["step"]) for r in read_csv(run / "eval.csv")] == [("T1", 0.25, 2),
                                                                                             ("T10", 0.75, 2)]
    before = (run / "eval.csv").read_text()
    assert final_eval_csv(run) is None and (run / "eval.csv").read_text() == before
    (run / "eval.csv").unlink()                                     # the claim-3 report step writes it too
    logs = []
    ctx = EntryContext(name="report", out_dir=tmp_path / "bench", log=logs.append, deadline=time.monotonic() + 60)
    run_report(ReplicationReportOptions(claim=3, root=str(tmp_path), runs=("mqar-mixer-s1",)), ctx)
    assert (run / "eval.csv").read_text() == before and any("from its last validation" in x for x in logs)
