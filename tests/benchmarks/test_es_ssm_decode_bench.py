"""The ES-SSM decode benchmark (suite kind ``es_ssm_decode``, ``benchmarks/es_ssm_decode.py``; the ``decode`` entry of
the ``es-ssm`` suite): CPU smoke test of its plumbing, and GPU tests (marker ``gpu``, not run in CI) of the decoders on
CUDA and of the entry at the byte-base shapes. Run the GPU part with
``python -m pytest -m gpu tests/benchmarks/test_es_ssm_decode_bench.py``."""

import json

import pytest
import torch

from benchmarks.es_ssm_decode import EsSsmDecodeOptions, build_es_ssm, run_es_ssm_decode
from benchmarks.suite import EntryContext
from elastic_ssm.cli import main as cli_main
from elastic_ssm.config import ConfigError, ESSSMConfig
from elastic_ssm.elastic.tiers import state_bytes


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ELASTIC_SSM_CACHE", str(tmp_path_factory.getbasetemp() / "hankel_cache"))


def _run(tmp_path, **options) -> list[dict]:
    ctx = EntryContext(name="decode", out_dir=tmp_path / "decode", log=lambda s: None)
    return run_es_ssm_decode(EsSsmDecodeOptions(**options), ctx)


def test_es_ssm_decode_entry_cpu_smoke(tmp_path):
    rows = {(r["K"], r["decode"], r["batch"]): r for r in _run(
        tmp_path, preset="tiny", budgets=(2, 8), batches=(1, 3), n_modes=4, warmup=1, iters=2, device="cpu")}
    assert len(rows) == 8 and not any("error" in r for r in rows.values())
    tiny = ESSSMConfig.preset("tiny")
    for (K, decode, B), r in rows.items():
        assert r["ms"] > 0 and r["tok_s"] == pytest.approx(B / r["ms"] * 1e3) and r["mode"] == "eager"
        want = state_bytes(tiny, K, decode=decode, n_modes=4)["total"]
        assert r["state_bytes_per_seq"] == want and r["m"] == (4 if decode == "modal" else "-")


def test_es_ssm_decode_entry_through_the_suite_cli_and_validation(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["bench", "--bench.suite", "es-ssm", "--bench.only", "decode", "--bench.set", "preset=tiny",
                   "budgets=[4]", "batches=[1]", "decoders=[exact]", "--bench.warmup", "1", "--bench.iters", "1",
                   "--bench.device", "cpu", "--bench.out_dir", str(out)])
    assert rc == 0, capsys.readouterr().err
    (entry,) = json.loads((out / "es-ssm.json").read_text())["entries"]
    assert [(r["K"], r["decode"], r["batch"]) for r in entry["rows"]] == [(4, "exact", 1)]
    assert "ms" in entry["rows"][0] and "## decode (es_ssm_decode)" in (out / "es-ssm.md").read_text()
    with pytest.raises(ConfigError, match="decoders"):
        EsSsmDecodeOptions(decoders=("fast",))
    with pytest.raises(ConfigError, match=r"budgets: \[9\] outside \[1, 8\] of the tiny preset"):
        _run(tmp_path, preset="tiny", budgets=(9,), device="cpu")


def test_a_failing_or_late_row_is_the_rows_error(tmp_path, monkeypatch):
    import benchmarks.es_ssm_decode as bench

    def broken(*args):
        raise RuntimeError("no decoder\nsecond line")

    monkeypatch.setattr(bench, "EsSsmDecoder", broken)
    rows = _run(tmp_path, preset="tiny", budgets=(2,), batches=(1, 2), decoders=("exact",), device="cpu")
    assert [r["error"] for r in rows] == ["RuntimeError: no decoder"] * 2
    ctx = EntryContext(name="decode", out_dir=tmp_path, log=lambda s: None, deadline=0.0)
    rows = run_es_ssm_decode(EsSsmDecodeOptions(preset="tiny", budgets=(2,), batches=(1,), device="cpu"), ctx)
    assert rows[0]["error"] == "skipped: time budget" and rows[0]["batch"] == 1


@pytest.mark.gpu
def test_es_ssm_decoders_on_cuda_match_the_forward():
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
def test_es_ssm_decode_entry_on_cuda_byte_base(tmp_path):
    rows = _run(tmp_path, warmup=5, iters=20, device="cuda")
    assert len(rows) == 3 * 2 * 2 and not any("error" in r for r in rows)
    assert all(r["ms"] > 0 for r in rows)
