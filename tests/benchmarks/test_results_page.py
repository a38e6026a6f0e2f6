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


@pytest.mark.parametrize("name", ["claim1", "claim1-gaps", "claim2", "claim5"])
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
