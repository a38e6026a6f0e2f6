"""The ES-SSM decode benchmark entry (``elastic-ssm bench --bench.benchmarks es_ssm_decode``): CPU smoke test of
its plumbing, and GPU tests (marker ``gpu``, not run in CI) of the decoders on CUDA and of the entry at the
byte-base shapes. Run the GPU part with ``python -m pytest -m gpu tests/bench/test_es_ssm_decode_bench.py``."""

import pytest
import torch

from elastic_ssm.bench import BenchConfig, bench_command, run_bench
from elastic_ssm.cli import parse
from elastic_ssm.cli_util import overrides
from elastic_ssm.config import ConfigError, ESSSMConfig
from elastic_ssm.elastic.tiers import state_bytes


def main(argv: list[str]) -> dict:
    """``elastic-ssm bench ARGV`` in process (``--bench.preset 1.5b ...``); returns the results."""
    return bench_command(overrides(parse("bench", list(argv)), "bench"))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path_factory.getbasetemp() / "hankel_cache"))


def test_es_ssm_decode_entry_cpu_smoke(tmp_path):
    docs = tmp_path / "benchmarks.md"
    cfg = BenchConfig(benchmarks=("es_ssm_decode",), es_ssm_preset="tiny", es_ssm_budgets=(2, 8),
                      es_ssm_batches=(1, 3), es_ssm_modes=4, warmup=1, iters=2, out="", docs=str(docs),
                      device="cpu")
    res = run_bench(cfg, log=lambda s: None)
    rows = {(r["K"], r["decode"], r["batch"]): r for r in res["es_ssm_decode"]}
    assert len(rows) == 8 and not any("error" in r for r in rows.values())
    tiny = ESSSMConfig.preset("tiny")
    for (K, decode, B), r in rows.items():
        assert r["ms"] > 0 and r["tok_s"] == pytest.approx(B / r["ms"] * 1e3)
        want = state_bytes(tiny, K, decode=decode, n_modes=4)["total"]
        assert r["state_bytes_per_seq"] == want and r["m"] == (4 if decode == "modal" else "-")
    assert res["decode"] == [] and res["memory"] == []  # only the requested entry ran
    text = docs.read_text()
    assert "## es_ssm_decode" in text and "modal" in text


def test_es_ssm_decode_entry_cli_and_validation():
    res = main(["--bench.benchmarks", "es_ssm_decode", "--bench.es_ssm_preset", "tiny", "--bench.es_ssm_budgets",
                "4", "--bench.es_ssm_batches", "1", "--bench.es_ssm_decoders", "exact", "--bench.warmup", "1",
                "--bench.iters", "1", "--bench.out", "", "--bench.device", "cpu"])
    assert [(r["K"], r["decode"], r["batch"]) for r in res["es_ssm_decode"]] == [(4, "exact", 1)]
    with pytest.raises(ConfigError, match="es_ssm_decoders"):
        BenchConfig(es_ssm_decoders=("fast",))
    with pytest.raises(ConfigError, match=r"es_ssm_budgets: \[9\] outside \[1, 8\]"):
        run_bench(BenchConfig(benchmarks=("es_ssm_decode",), es_ssm_preset="tiny", es_ssm_budgets=(9,),
                              out="", device="cpu"), log=lambda s: None)
    assert "es_ssm_decode" not in BenchConfig().benchmarks  # opt-in: the default run is unchanged


@pytest.mark.gpu
def test_es_ssm_decoders_on_cuda_match_the_forward():
    from elastic_ssm.bench.es_ssm_decode import build_es_ssm

    dev = torch.device("cuda")
    cfg = ESSSMConfig.preset("small")
    torch.manual_seed(0)
    model = build_es_ssm(cfg, dev, torch.float32)
    x = torch.randint(0, cfg.vocab_size, (4, 96), device=dev)
    for K in (2, 8, cfg.n_channels):
        ref = model(x, tier=K)
        cache = model.allocate_cache(4, K)
        got = torch.cat([model(x[:, :16], tier=K, cache=cache)]
                        + [model.step(x[:, t], cache)[:, None] for t in range(16, 96)], 1)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4, K


@pytest.mark.gpu
def test_es_ssm_decode_entry_on_cuda_byte_base():
    cfg = BenchConfig(benchmarks=("es_ssm_decode",), warmup=5, iters=20, out="", device="cuda")
    res = run_bench(cfg, log=print)
    rows = res["es_ssm_decode"]
    assert len(rows) == 3 * 2 * 2 and not any("error" in r for r in rows)
    assert all(r["ms"] > 0 for r in rows)
