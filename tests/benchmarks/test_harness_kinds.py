"""Suite kinds of the research harness (``benchmarks/`` at the repository root, not installed): an entry of such a
kind loads from the repository root, and elsewhere (no ``benchmarks`` importable, no clone in the current folder)
the suite is a one-line error naming the kind and the folder it belongs to."""

import sys
from pathlib import Path

import pytest

from benchmarks import kinds
from benchmarks.suite import load_suite
from elastic_ssm import bench as harness
from elastic_ssm.cli import main as cli_main
from elastic_ssm.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SUITE = "entries:\n  - {name: sweep, kind: gemv_sweep}\n"


@pytest.fixture
def no_harness(tmp_path, monkeypatch):
    """The installed ``elastic-ssm`` run outside a clone: the current folder is ``tmp_path``, no ``sys.path`` entry
    holds ``benchmarks/`` and none of its modules is loaded yet."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(harness, "CHECKOUT", tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not (Path(p or ".").resolve() / "benchmarks" / "__init__.py").is_file()])
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "suite.yaml").write_text(SUITE)
    return tmp_path


def test_every_kind_names_a_benchmarks_module():
    assert all(module.startswith("benchmarks.") for module, _, _ in kinds.KINDS.values())
    assert {"bench", "command", "gemv_sweep", "memory", "es_ssm_decode", "replication_step"} <= kinds.KINDS.keys()
    for k in kinds.KINDS:
        assert kinds.kind_runner(k).__module__ == kinds.KINDS[k][0]


def test_a_harness_kind_outside_a_clone_is_a_one_line_error(no_harness, capsys):
    with pytest.raises(ConfigError, match="entry kind 'gemv_sweep' belongs to the research harness") as e:
        kinds.kind_options("gemv_sweep")
    assert "benchmarks/" in str(e.value) and "root of a clone" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="entry 'sweep': entry kind 'gemv_sweep' belongs"):
        load_suite(no_harness / "suite.yaml")
    assert cli_main(["bench", "--bench.suite", str(no_harness / "suite.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "research harness" in err and len(err.splitlines()) == 1, err
    # at most tests/benchmarks/ as a namespace package (pytest puts tests/ on sys.path), never the harness
    assert getattr(sys.modules.get("benchmarks"), "__file__", None) is None


def test_a_harness_kind_loads_from_the_repository_root(no_harness, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert kinds.kind_options("gemv_sweep").__name__ == "GemvSweepOptions"
    assert kinds.kind_options("bench").__name__ == "BenchConfig"
    assert kinds.kind_runner("replication_report").__module__ == "benchmarks.replication.report"
    assert sys.modules["benchmarks"].__file__ == str(ROOT / "benchmarks" / "__init__.py")


def test_an_editable_install_finds_the_harness_of_its_checkout(no_harness, monkeypatch):
    monkeypatch.setattr(harness, "CHECKOUT", ROOT)       # run from elsewhere; elastic_ssm imported from the clone
    assert load_suite(no_harness / "suite.yaml").entries[0].options.__class__.__name__ == "GemvSweepOptions"


def test_the_fla_peers_outside_a_clone_are_an_unavailable_peer(no_harness):
    """``benchmarks/fla_peers.py`` is the harness's: outside a clone a gated_deltanet / mamba2 row says where it lives
    (a ``PeerUnavailable``, reported in the row, not a failure)."""
    from elastic_ssm.bench.decode import PeerUnavailable, fla_peers

    with pytest.raises(PeerUnavailable, match="fla peer module belongs to the research harness") as e:
        fla_peers()
    assert "root of a clone" in str(e.value) and "\n" not in str(e.value)


def test_suites_outside_a_clone_are_a_one_line_error(no_harness, capsys):
    """``--bench.suite`` loads ``benchmarks/suite.py`` of a clone; without one (``list`` too) it says so in one line."""
    for name in ("list", str(no_harness / "suite.yaml")):
        assert cli_main(["bench", "--bench.suite", name]) == 2
        err = capsys.readouterr().err.strip()
        assert "bench suites run from a clone of the repository" in err and len(err.splitlines()) == 1, err
