"""Decoding memory per sequence (suite kind ``memory``, ``benchmarks/memory.py``; entries of the ``h200`` and
``cpu-smoke`` suites): the allocated cache of every tier equals ``elastic.tiers.state_bytes`` and Table 53."""

import pytest

import elastic_ssm as es
from benchmarks.memory import MemoryOptions, essh_memory_rows, run_memory
from benchmarks.suite import EntryContext


def test_memory_matches_formula_and_table53():
    rows = {r["tier"]: r for r in essh_memory_rows(es.ESSHConfig.preset("1.5b"), ["T1", "T10"])}
    assert all(r["match"] for r in rows.values())
    assert round(rows["T1"]["total"] / 1e6, 2) == 51.15 and round(rows["T10"]["total"] / 1e6, 2) == 53.61
    (r370,) = essh_memory_rows(es.ESSHConfig.preset("370m"), ["T10"], batch=4)
    assert r370["match"] and round(r370["total"] / 1e6, 2) == 23.11                   # Table 61(b)


def test_memory_entry_counts_every_tier_and_the_transformer(tmp_path):
    ctx = EntryContext(name="memory", out_dir=tmp_path, log=lambda s: None)
    rows = run_memory(MemoryOptions(preset="tiny", context=512), ctx)
    assert [r["model"] for r in rows] == ["essh"] * 10 + ["transformer"]
    assert all(r["match"] and r["preset"] == "tiny" for r in rows)
    assert rows[-1]["kv"] == rows[-1]["total"] > 0 and rows[-1]["recurrent"] == 0
    assert [r["model"] for r in run_memory(MemoryOptions(preset="tiny", peers=("mamba2",)), ctx)] == ["essh"] * 10
    with pytest.raises(es.ConfigError, match="unknown ESSH preset 'huge'"):
        run_memory(MemoryOptions(preset="huge"), ctx)
