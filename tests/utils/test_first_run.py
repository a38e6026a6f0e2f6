"""The fresh-machine notice around the first CUDA prefill (``utils/progress.py``): one line before, a line per
``every`` seconds while it lasts, one after; nothing on a warm cache, on the CPU, or a second time."""

import logging
import time
from types import SimpleNamespace

import pytest

from elastic_ssm.utils import progress as first_run

CUDA = SimpleNamespace(type="cuda")


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    monkeypatch.setattr(first_run, "_CHECKED", [])


def test_a_cold_cache_says_what_happens_with_progress(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="elastic_ssm"):
        with first_run.tuning_notice(CUDA, every=0.05, cache=tmp_path):
            time.sleep(0.18)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"tuning kernels for this GPU (first run only, cached in {tmp_path}): about a minute"
    assert any(x.startswith("still tuning kernels: ") for x in lines[1:-1])
    assert lines[-1].startswith("kernels tuned in ") and str(tmp_path) in lines[-1]
    with caplog.at_level(logging.WARNING, logger="elastic_ssm"):
        caplog.clear()
        with first_run.tuning_notice(CUDA, cache=tmp_path):     # once per process
            pass
    assert not caplog.records


def test_warm_cache_cpu_and_the_default_dir_are_silent(tmp_path, caplog, monkeypatch):
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "kernel.autotune.json").write_text("{}")
    assert first_run.kernels_tuned(tmp_path) and not first_run.kernels_tuned(tmp_path / "missing")
    compiled = tmp_path / "compiled"                 # shipped configs: Triton compiled the scan but timed nothing
    (compiled / "def").mkdir(parents=True)
    (compiled / "def" / "other_kernel.cubin").write_bytes(b"")
    assert not first_run.kernels_tuned(compiled)     # another kernel's files say nothing of the scan
    (compiled / "def" / "chunk_gla_fwd_kernel_o.cubin").write_bytes(b"")
    assert first_run.kernels_tuned(compiled)
    with caplog.at_level(logging.WARNING, logger="elastic_ssm"):
        with first_run.tuning_notice(CUDA, cache=tmp_path):
            pass
        with first_run.tuning_notice(SimpleNamespace(type="cpu"), cache=tmp_path / "missing"):
            pass
        with first_run.tuning_notice(CUDA, cache=tmp_path / "missing"):   # the cache is read once per process:
            pass                                                           # later generate calls glob nothing
    assert not caplog.records
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert first_run.triton_cache_dir() == tmp_path
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert first_run.triton_cache_dir().parts[-2:] == (".triton", "cache")


def test_an_error_inside_still_ends_the_notice(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_ssm"), pytest.raises(RuntimeError, match="boom"):
        with first_run.tuning_notice(CUDA, every=10, cache=tmp_path):
            raise RuntimeError("boom")
    assert caplog.records[-1].getMessage().startswith("kernel tuning stopped after ")


def test_the_notice_names_the_shipped_configs_fla_reads(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("FLA_CONFIG_DIR", "/pkg/ops/fla_configs/NVIDIA_H200")
    with caplog.at_level(logging.WARNING, logger="elastic_ssm"):
        with first_run.tuning_notice(CUDA, every=10, cache=tmp_path):
            pass
    assert caplog.records[0].getMessage() == (
        f"tuning kernels for this GPU (first run only, cached in {tmp_path}; tuned configs of known shapes from "
        "/pkg/ops/fla_configs/NVIDIA_H200): those compile in seconds, a new shape tunes for about a minute")
