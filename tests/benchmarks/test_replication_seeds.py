"""Claim 1 over seeds (eval/replication.py): run folders ``<arm>-s<seed>`` are seeds of one arm; ``seed_stats`` gives
each arm's mean, range and n per tier, ``paired_gaps`` the same-seed gaps, and the claim-1 summary says whether a gap
keeps its sign at every seed."""

import pytest

from benchmarks.replication.claims import arm_of, base_of, collect_claim, seed_of
from benchmarks.replication.seeds import paired_gaps, seed_stats


def _eval(root, run, rows):
    (root / run).mkdir(parents=True)
    lines = ["tier,K,n_ff,params,xi,bpb"] + [f"{t},8,192,{p},{x},{b}" for t, x, p, b in rows]
    (root / run / "eval.csv").write_text("\n".join(lines) + "\n")


def test_names():
    assert [arm_of(n) for n in ("essh-s1", "dense-rec33-s0", "transformer-lr0.002", "matformer")] == [
        "essh", "dense-rec33", "transformer-lr0.002", "matformer"]       # another learning rate is another arm
    assert [base_of(n) for n in ("transformer-lr0.002", "mqar-mixer-lr0.0006-s1", "mqar-mixer-lr6e-4-s0")] == [
        "transformer", "mqar-mixer", "mqar-mixer"]
    assert [seed_of(n) for n in ("essh-s12", "transformer-lr0.002")] == [12, None]


def test_seed_stats_and_gaps(tmp_path):
    for s, (e, d) in enumerate([(1.079, 1.119), (1.062, 1.050), (1.066, 1.054)]):
        _eval(tmp_path, f"essh-s{s}", [("T1", 0.0625, 7, 1.3 + s / 100), ("T10", 1, 41, e)])
        _eval(tmp_path, f"dense-s{s}", [("T1", 0.0625, 7, 5.0), ("T10", 1, 41, d)])
    _eval(tmp_path, "spec-t1-s1", [("T1", 1, 7, 1.2)])
    runs = [f"{a}-s{s}" for a in ("essh", "dense") for s in range(3)] + ["spec-t1-s1", "spec-t1-s2"]
    res = collect_claim(1, tmp_path, runs)
    assert res["missing"] == ["spec-t1-s2"]
    t10 = res["summary"]["seeds"]["essh"]["T10"]
    assert (t10["n"], t10["min"], t10["max"]) == (3, 1.062, 1.079)
    assert t10["mean"] == pytest.approx((1.079 + 1.062 + 1.066) / 3)
    gap = res["summary"]["gaps"]["T10 shared - dense"]
    assert gap["seeds"] == pytest.approx({0: -0.040, 1: 0.012, 2: 0.012})
    assert gap["sign_resolved"] is False                        # -0.040 .. +0.012: the range spans zero
    t1 = res["summary"]["gaps"]["T1 shared - specialist"]
    assert t1["n"] == 1 and t1["seeds"] == pytest.approx({1: 0.11}) and t1["sign_resolved"] is False   # one seed
    assert paired_gaps(res["rows"], "dense", "essh", "T1") == pytest.approx({0: 3.7, 1: 3.69, 2: 3.68})
    assert seed_stats(res["rows"])["spec-t1"]["T1"]["n"] == 1


def test_a_recovery_is_paired_with_the_run_it_started_from(tmp_path):
    """``dense-rec-s0`` recovered from ``dense-s0-retrain`` (its run.yaml's ``recover.source``): its gap to the dense
    control is taken against that run, not against ``dense-s0``; a recovery without a source pairs by seed."""
    _eval(tmp_path, "dense-s0", [("T10", 1, 41, 1.119)])
    _eval(tmp_path, "dense-s0-retrain", [("T10", 1, 41, 1.058)])
    _eval(tmp_path, "dense-s1", [("T10", 1, 41, 1.050)])
    _eval(tmp_path, "dense-rec-s0", [("T10", 1, 41, 1.074)])
    _eval(tmp_path, "dense-rec-s1", [("T10", 1, 41, 1.062)])
    (tmp_path / "dense-rec-s0" / "run.yaml").write_text("recover:\n  source: dense-s0-retrain\n")
    _eval(tmp_path, "dense-s1-retrain", [("T10", 1, 41, 1.040)])
    # as recover writes it: its PARENT argument, a run folder's final model
    (tmp_path / "dense-rec-s1" / "run.yaml").write_text("recover:\n  source: runs/replication/dense-s1-retrain/final\n")
    res = collect_claim(1, tmp_path, ["dense-s0", "dense-s1", "dense-s0-retrain", "dense-s1-retrain", "dense-rec-s0",
                                      "dense-rec-s1"])
    gap = res["summary"]["gaps"]["T10 recovered (paper's share) - dense"]
    assert gap["seeds"] == pytest.approx({0: 1.074 - 1.058, 1: 1.062 - 1.040})
    assert res["summary"]["seeds"]["dense"]["T10"]["n"] == 2      # the repeat is its own arm, not a third seed
    assert {r["role"] for r in res["rows"] if r["run"] == "dense-s0-retrain"} == {"repeat"}
