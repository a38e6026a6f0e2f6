"""docs/results.md against the committed run records (``python -m benchmarks.results_page --check``): the page
passes, and a page whose claim table differs from the records by one digit, lacks a table region, or carries a
hand-typed table in a claim section fails."""

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))          # benchmarks/ is research harness beside the package, not installed
results_page = importlib.import_module("benchmarks.results_page")
PAGE = ROOT / "docs" / "results.md"


def test_committed_page_agrees_with_the_records(capsys):
    assert results_page.main(["--check"]) == 0, capsys.readouterr()


def test_the_check_line_is_in_the_first_20_lines_once():
    head = PAGE.read_text().splitlines()[:20]
    assert [ln for ln in head if ln.startswith("Check:")] == ["Check: `python -m benchmarks.results_page --check`"]
    assert sum(ln.startswith("Check:") for ln in PAGE.read_text().splitlines()) == 1


def _region(text, name):
    m = re.search(rf"<!-- table: {re.escape(name)} -->\n(.*?)<!-- /table -->", text, re.S)
    return m.start(1), m.end(1)


@pytest.mark.parametrize("name", ["claim1", "claim1-gaps", "claim2", "claim3-seeds", "claim5"])
def test_one_changed_digit_in_a_claim_table_fails(tmp_path, name, capsys):
    text = PAGE.read_text()
    start, end = _region(text, name)
    body = text[start:end]
    digit = re.search(r"\d\.\d{3}", body)                 # the first number with three decimals
    pos = start + digit.end() - 1
    changed = text[:pos] + str((int(text[pos]) + 1) % 10) + text[pos + 1:]
    page = tmp_path / "results.md"
    page.write_text(changed)
    assert results_page.main(["--check", "--page", str(page)]) == 1
    assert "differ from the records" in capsys.readouterr().err
    assert results_page.main(["--write", "--page", str(page)]) == 0       # --write puts the records' digit back
    assert page.read_text() == text


def test_a_missing_region_or_a_hand_typed_claim_table_fails(tmp_path, capsys):
    text = PAGE.read_text()
    page = tmp_path / "results.md"
    start, end = _region(text, "claim4")
    no_region = text.replace("<!-- table: claim4 -->\n" + text[start:end] + "<!-- /table -->\n", text[start:end])
    page.write_text(no_region)
    assert results_page.main(["--check", "--page", str(page)]) == 1
    err = capsys.readouterr().err
    assert "no region for table 'claim4'" in err and "outside a generated region" in err


def test_seed_cells_give_mean_range_and_n():
    c = {"n": 3, "mean": 1.069, "min": 1.062, "max": 1.079}
    assert results_page.cell(c) == "1.069 (1.062 to 1.079, n=3)"
    assert results_page.cell({"n": 1, "mean": 1.2, "min": 1.2, "max": 1.2}) == "1.200 (n=1)"


def test_evaluation_tables_render_their_records_and_say_what_is_missing(tmp_path):
    """queue item 7's tables (``benchmarks/results_evals.py``): the Table 31 statistics of each importance run, every
    named tier's bits per byte at 1024 / 2048 / 4096 (fractions left out), NIAH per tier; a run without records
    renders as "not run yet"."""
    import json

    from benchmarks.results_evals import importance, length, niah

    assert importance(tmp_path).count("not run yet") == 2 and "not run yet" in length(tmp_path) + niah(tmp_path)
    (tmp_path / "importance-essh").mkdir()
    (tmp_path / "importance-essh" / "channel_importance.json").write_text(json.dumps(
        {"K": 32, "first": 8, "batches": 8, "seq_len": 1024, "ordering_energy": 0.7123, "ordering_knockout": 0.81,
         "share_energy": 0.5, "share_knockout": 0.6349}))
    row = next(r for r in importance(tmp_path).splitlines() if r.startswith("| ESSH"))
    assert "| 0.71 | 0.81 | 0.50 | 0.63 | 0.66 / 0.82 / 0.46 / 0.64 | K = 32, first 8, 8 x 1024 tokens |" in row
    for run, lens in (("essh-s0", ((1024, 1.5),)), ("length-essh", ((2048, 1.6), (4096, 1.75)))):
        (tmp_path / run).mkdir()                      # the sweep: one eval.csv, a row per tier and seq_len
        (tmp_path / run / "eval.csv").write_text("tier,seq_len,bpb\n" + "".join(
            f"T1,{n},{bpb + 0.5}\nxi=0.14,{n},9\nT10,{n},{bpb}\n" for n, bpb in lens))
    table = length(tmp_path)
    assert "| ESSH capacity-mixed + SR | T10 | 1.500 | 1.600 | 1.750 | +0.250 |" in table
    assert "| T1 | 2.000 |" in table and "xi=" not in table
    assert "dense control (nothing nested) |  |  |  |  | not run yet" in table
    (tmp_path / "niah-essh").mkdir()
    (tmp_path / "niah-essh" / "eval.csv").write_text(
        "tier,full_key,first_token,half_width,d0.1,d0.5\nT4,0.5,0.75,0.1,0.25,1.0\n")
    assert "| T4 | 0.500 | 0.750 | 0.100 | 0.25 / 1.00 |" in niah(tmp_path) and "depths 0.1 / 0.5" in niah(tmp_path)


def _record(root: Path, run: str, lr: float, bpb: dict[str, float], losses=(2.0, 2.5, 2.2)) -> None:
    d = root / run
    d.mkdir(parents=True)
    (d / "run.yaml").write_text(f"train:\n  seed: 0\n  optim:\n    lr: {lr}\n")
    (d / "eval.csv").write_text("tier,bpb\n" + "".join(f"{t},{b}\n" for t, b in bpb.items()))
    (d / "metrics.jsonl").write_text("".join(
        f'{{"kind": "train", "step": {s}, "loss": {v}, "grad_norm": 1.5, "stage": "pretrain", "tokens": {s}, '
        f'"tokens_per_s": 1e5}}\n'
        for s, v in zip((10, 20, 30), losses)))


def test_the_page_compares_each_baseline_at_its_best_learning_rate(tmp_path):
    claim1 = importlib.import_module("benchmarks.results_claim1")
    _record(tmp_path, "transformer-lr0.002", 0.002, {"T1": 1.371})
    _record(tmp_path, "transformer-lr0.001", 0.001, {"T1": 1.124})
    _record(tmp_path, "transformer-lr0.004", 0.004, {"T1": 1.5})
    _record(tmp_path, "matformer", 0.002, {"T1": 3.6, "T2": 1.9, "T10": 1.777})    # the widest tier, not the first
    assert claim1.lr_runs(tmp_path, "matformer") == {"matformer": (0.002, 1.777)}
    assert claim1.best_run(tmp_path, "transformer") == "transformer-lr0.001"
    rows = [ln for ln in claim1.baselines_table(tmp_path).splitlines() if "transformer-lr" in ln]
    assert [ln.split(" | ")[1] for ln in rows] == ["transformer-lr0.001", "transformer-lr0.002", "transformer-lr0.004"]
    assert [ln.rstrip(" |").endswith("yes") for ln in rows] == [True, False, False]


def test_a_same_seed_repeat_is_set_against_its_first_run(tmp_path):
    claim1 = importlib.import_module("benchmarks.results_claim1")
    _record(tmp_path, "essh-s0", 0.002, {"T1": 1.36, "T4": 1.157, "T10": 1.079})
    _record(tmp_path, "essh-s0-retrain", 0.002, {"T1": 1.409, "T4": 1.181, "T10": 1.1}, losses=(2.1, 2.6, 2.0))
    out = claim1.repeat_table(tmp_path)          # dense-s0 and its repeat have no records here: no rows
    assert "dense-s0" not in out
    diff = next(ln for ln in out.splitlines() if ln.startswith("| essh-s0-retrain - essh-s0"))
    assert diff.split(" | ")[-3:] == ["+0.049", "+0.024", "+0.021 |"]


def test_the_4x_table_sets_each_length_gap_and_names_the_missing_run(tmp_path):
    claim1 = importlib.import_module("benchmarks.results_claim1")
    _record(tmp_path, "essh-s0", 0.002, {"T1": 1.36, "T10": 1.079})
    _record(tmp_path, "dense-s0", 0.002, {"T1": 4.868, "T10": 1.119})
    _record(tmp_path, "dense-long-s0", 0.002, {"T1": 8.182, "T10": 0.799})
    lines = claim1.long_table(tmp_path).splitlines()
    t1 = next(ln for ln in lines if ln.startswith("| T1 |"))
    assert t1.split(" | ")[1:] == ["1.360", "", "4.868", "8.182", "-3.508", " |"]      # no 2,600-step ESSH: no gap
    assert lines[-1].startswith("| not run yet: essh-long-s0 |")
    _record(tmp_path, "essh-long-s0", 0.002, {"T1": 1.2, "T10": 0.81})
    lines = claim1.long_table(tmp_path).splitlines()
    assert next(ln for ln in lines if ln.startswith("| T10 |")).split(" | ")[-2:] == ["-0.040", "+0.011 |"]
    assert not any("not run yet" in ln for ln in lines)


def test_claim2_gaps_pair_each_seed_with_its_own_run(monkeypatch):
    """claim 2's "without - with" gap is taken per seed, only over the seeds both arms ran."""
    rows = [{"run": f"{arm}-s{seed}", "arm": arm, "seed": seed, "K": k, "tier": f"K{k}", "bpb": bpb}
            for arm, seed, k, bpb in (
        ("essm-bd", 0, 4, 1.80), ("essm-full", 0, 4, 2.00), ("essm-bd", 1, 4, 1.90), ("essm-full", 1, 4, 2.00),
        ("essm-bd", 2, 4, 1.00), ("essm-bd", 0, 32, 1.78), ("essm-full", 0, 32, 1.66))]
    monkeypatch.setattr(results_page, "claim", lambda n: {"rows": rows})
    gaps = results_page.claim2_gaps()
    assert gaps[4]["n"] == 2 and gaps[4]["mean"] == pytest.approx(0.15)     # seed 2 has no K = 32-only run
    assert (gaps[4]["min"], gaps[4]["max"]) == (pytest.approx(0.1), pytest.approx(0.2))
    assert gaps[32]["n"] == 1 and results_page.cell(gaps[32], results_page.sgn) == "-0.120 (n=1)"


def test_the_importance_plot_draws_both_models_from_the_records(tmp_path):
    """``python -m benchmarks.results_evals`` redraws docs/results/importance.png from the committed
    ``importance-<model>`` records; without records it says so and writes nothing."""
    pytest.importorskip("matplotlib")
    evals = importlib.import_module("benchmarks.results_evals")
    out = tmp_path / "importance.png"
    assert evals.plot_importance_records(ROOT / "docs" / "results" / "records", out) == ""
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    empty = tmp_path / "none.png"
    assert evals.plot_importance_records(tmp_path, empty) == "no importance records" and not empty.exists()


def test_the_4x_sentence_follows_its_records(tmp_path):
    """The summary's 4x clause is "" until both 2,600-step runs have an eval.csv; then it gives T10 shared - dense,
    whether that is the paper's sign (Table 37: the dense control better), and whether it lies inside ``noise``."""
    from benchmarks.results_claim1 import LONG, long_clause

    assert long_clause(tmp_path, 0.05) == ""

    def write(run, bpb):
        (tmp_path / run).mkdir(exist_ok=True)
        (tmp_path / run / "eval.csv").write_text(f"tier,K,bpb\nT1,8,1.5\nT10,32,{bpb}\n")

    (essh, dense) = (LONG[0][2], LONG[1][2])
    write(essh, 0.818)
    assert long_clause(tmp_path, 0.05) == ""
    write(dense, 0.799)
    assert "T10 shared - dense +0.019, the paper's sign" in long_clause(tmp_path, 0.05)
    assert "inside the 1x same-seed repeats' 0.050" in long_clause(tmp_path, 0.05)
    write(dense, 0.900)
    clause = long_clause(tmp_path, 0.05)
    assert "-0.082, not the paper's sign" in clause and "outside" in clause


def test_claim3_takes_each_seeds_run_that_has_a_record_and_gives_its_arms_spread(tmp_path):
    """A run of replication-mqar-seeds joins claim 3's tables once it has an eval.csv (not before: a number never
    stands without its record); the seeds table gives each arm's mean [min, max] over exactly those runs."""
    import shutil

    rc3 = importlib.import_module("benchmarks.results_claim3")
    src = ROOT / "docs" / "results" / "records"
    for run in ("mqar-hybrid-s0", "mqar-mixer-s0", "mqar-hybrid-s1", "mqar-hybrid-s2"):
        shutil.copytree(src / run, tmp_path / run)
    (tmp_path / "mqar-hybrid-s2" / "eval.csv").unlink()           # trained but without its record
    assert rc3.claim3_runs(tmp_path) == ("mqar-hybrid-s0", "mqar-hybrid-s1", "mqar-mixer-s0")
    seeds = rc3.claim3_data(tmp_path)["seeds"]["mqar-hybrid"]["T1"]
    assert seeds["n"] == 2 and seeds["min"] <= seeds["mean"] <= seeds["max"]
    row = next(ln for ln in rc3.claim3_seeds(tmp_path).splitlines() if ln.startswith("| mqar-hybrid |"))
    assert row.startswith("| mqar-hybrid | 2 (s0, s1) | ") and f"[{rc3.acc(seeds['min'])}, " in row
    assert "| mqar-mixer | 1 (s0) | 0.243 | 0.607 | 0.694 |" in rc3.claim3_seeds(tmp_path)
    assert rc3.seed_cell({"n": 1, "mean": 0.5, "min": 0.5, "max": 0.5}) == "0.500"
