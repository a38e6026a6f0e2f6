"""configs/replication/ (issue 16): every run file loads; the arms of a claim share tokens, schedule and seed
and differ only in model and recipe; the baselines are parameter-matched (Tables 8/9/43); the suites agree."""

import re
from pathlib import Path

import pytest

from benchmarks.suite import load_suite
from elastic_ssm.config import RunConfig
from elastic_ssm.elastic.tiers import parameter_report

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = {"lm": ["essh", "dense", "spec-t1", "spec-t4", "matformer", "transformer"], "es_ssm": ["essm-bd", "essm-full"],
          "mqar": ["mqar-hybrid", "mqar-mixer"]}


SUITES = ("replication-calibrate", "replication-claim1", "replication-claim2", "replication-claim3",
          "replication-claim4", "replication-claim5", "replication-seeds", "replication-queue", "replication-long",
          "replication-mqar-seeds", "replication-evals")


def _run(name):
    return RunConfig.from_yaml(ROOT / "configs" / "replication" / f"{name}.yaml")


def test_every_run_file_belongs_to_a_claim():
    files = {p.stem for p in (ROOT / "configs" / "replication").glob("*.yaml")}
    assert files == {n for names in CLAIMS.values() for n in names}


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_arms_share_tokens_schedule_and_seed(claim):
    runs = [_run(n) for n in CLAIMS[claim]]
    same = [({**r.train.to_dict(), "recipe": None}, r.data.to_dict()) for r in runs]
    assert all(s == same[0] for s in same)
    want = {"lm": ["capacity_mixed", "dense", "dense", "dense", "nested_ffn", "dense"],
            "es_ssm": ["budget_dropout", "dense"], "mqar": ["auto", "auto"]}[claim]
    assert [r.train.recipe for r in runs] == want
    if claim == "mqar":                         # the same model but for the attention block
        a, b = (r.model.to_dict() for r in runs)
        assert {k for k in a if a[k] != b[k]} == {"swa_layers"}


def test_lm_arms_are_matched_as_the_paper_matches_them():
    reports = {n: parameter_report(_run(n).model, _run(n).model_source) for n in CLAIMS["lm"]}
    full = reports["essh"]["params"]
    assert reports["dense"]["params"] == full
    assert reports["spec-t1"]["params"] == reports["essh"]["tiers"]["T1"]          # Table 43: exact tier shape
    assert reports["spec-t4"]["params"] == reports["essh"]["tiers"]["T4"]
    assert reports["matformer"]["reference"]["holds"] and abs(reports["matformer"]["params"] / full - 1) < 0.02
    assert reports["transformer"]["reference"]["holds"] and reports["transformer"]["params"] == reports["matformer"][
        "params"]                                                                     # MatFormer's backbone, dense
    mqar = {n: parameter_report(_run(n).model)["tiers"] for n in CLAIMS["mqar"]}
    assert mqar["mqar-hybrid"]["T10"] < mqar["mqar-mixer"]["T10"]                   # Table 21: 1.81M vs 2.04M


def test_suites_share_their_entries():
    one = {e.name: e for e in load_suite("replication-claim1").entries}
    for other in ("replication-claim4", "replication-claim5"):
        for e in load_suite(other).entries:
            if e.kind == "replication_step":
                assert e.options == one[e.name].options, (other, e.name)
    for name in SUITES:
        entries = load_suite(name).entries
        assert entries[0].options.action == "restore" and entries[-1].options.action == "pack"
        steps = [e for e in entries if e.kind == "replication_step"]
        for e in steps:
            for arg in e.options.args:
                if arg.startswith("configs/"):
                    assert (ROOT / arg).is_file(), (name, arg)


@pytest.mark.parametrize("suite", SUITES)
def test_run_names_say_their_seed_and_learning_rate(suite):
    """docs/results/records/<run>: a run named ``<arm>-s<seed>`` trains with that seed (``--train.seed``, else its
    run file's seed), ``<arm>-lr<lr>`` with that learning rate; a recovery recovers the dense control of its seed."""
    for e in load_suite(suite).entries:
        if e.kind != "replication_step" or e.name.endswith("-eval"):
            continue
        args, run = list(e.options.args), e.options.run
        flag = lambda f, args=args: args[args.index(f) + 1] if f in args else None      # noqa: E731
        config = next(a for a in args if a.startswith("configs/replication/"))
        seed = int(flag("--train.seed") or _run(Path(config).stem).train.seed)
        m = re.search(r"-s(\d+)(-retrain)?$", run)
        if m:
            assert int(m.group(1)) == seed, (suite, run, seed)
        lr = re.search(r"-lr([0-9.]+(e-?\d+)?)", run)
        if lr:
            want = flag("--train.optim.lr") or _run(Path(config).stem).train.optim.lr
            assert float(lr.group(1)) == float(want), (suite, run, want)
        if "recover" in args:
            assert re.search(rf"/dense-s{seed}(-retrain)?/final$", args[args.index("recover") + 1]), (suite, run)


def test_claim1_report_names_every_seed_the_suites_train():
    report = lambda s: next(e for e in load_suite(s).entries if e.kind == "replication_report").options.runs  # noqa
    runs = set(report("replication-claim1"))
    trained = {e.options.run for s in ("replication-seeds", "replication-queue") for e in load_suite(s).entries
               if e.kind == "replication_step" and re.match(r"(essh|dense|dense-rec|dense-rec33|spec-t1|spec-t4)-s\d+$",
                                                             e.options.run)}
    assert trained and trained <= runs, trained - runs
    assert set(report("replication-claim5")) <= runs | {"dense-rec33-s0"}
