"""The CLI's CPU threads (issue 41 item 8): the cores this process may use (affinity, narrowed by a cgroup v2 quota),
OMP_NUM_THREADS always wins, and a CPU run says it on its first line."""

import os

import pytest
import torch

from elastic_ssm.utils import environment as threads


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cgroup_quota_narrows_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")          # --cpus 1.5: two threads, not sixteen
    assert threads.available_cores(cpu_max) == (2, "cgroup quota")
    cpu_max.write_text("max 100000\n")
    assert threads.available_cores(cpu_max) == (16, "affinity")
    assert threads.available_cores(tmp_path / "absent") == (16, "affinity")


def test_the_default_follows_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: (1, "affinity"))
    torch.set_num_threads(2)
    line = threads.apply_default_threads()
    assert torch.get_num_threads() == 1 and line.startswith("cpu threads: 1 ") and "OMP_NUM_THREADS" in line
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert threads.apply_default_threads() == "cpu threads: 2 (OMP_NUM_THREADS)" and torch.get_num_threads() == 2


def test_a_cpu_run_names_its_threads_on_its_first_line(tmp_path, capsys, monkeypatch):
    import warnings

    from elastic_ssm.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {arch: essh, preset: tiny}\ntrain: {steps: 1, micro_batch_size: 2, seq_len: 32, "
                   f"device: cpu, eval: {{every: 0, batches: 1}}}}\ndata: {{source: {corpus}, tokenizer: bytes}}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(cfg), "--train.out_dir", str(tmp_path / "run")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("[train] cpu threads: ") and str(threads.available_cores()[0]) in first
