"""Benchmark harness and decode fast path on CPU: fused step == spec, FastDecoder == ESSH.step,
Transformer++ decode == forward, Table 54 matching, and an end-to-end tiny run (Table 53 memory: the research harness's
``memory`` kind, tests/benchmarks/test_memory.py)."""

import copy
import json
import os
import sys
import time

import pytest
import torch
from triton_interpreter import run_interpreted

import elastic_ssm as es
from elastic_ssm.bench import BenchConfig, bench_command, run_bench
from elastic_ssm.bench.decode import cast_matrices, match_ffn_width, transformer_matched
from elastic_ssm.cli import parse
from elastic_ssm.cli_util import overrides
from elastic_ssm.models.baselines import TransformerConfig, TransformerPP
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import FastDecoder
from elastic_ssm.ops.dispatch import resolve_decode_backend
from elastic_ssm.ops.spectral_scan import decode_triton as dt
from elastic_ssm.ops.spectral_scan.naive import naive_spectral_scan


def main(argv: list[str]) -> dict:
    """``elastic-ssm bench ARGV`` in process (``--bench.preset 1.5b ...``); returns the results."""
    return bench_command(overrides(parse("bench", list(argv)), "bench"))


def _perturbed(dtype, preset="tiny"):
    torch.manual_seed(0)
    cfg = es.ESSHConfig.preset(preset)
    model = es.ESSH(cfg).to(dtype).eval()
    return randomize_selective(model, ffn_out_std=0.1, zero_lag=True)  # every path matters


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fused_step_equals_naive_scan_step():
    model = _perturbed(torch.float64)
    mixer, K = model.blocks[0].mixer, 5
    B, M, P = 3, mixer.M, mixer.P
    u = torch.randn(B, mixer.D, dtype=torch.float64)
    state = torch.randn(B, K, M, 2, P, dtype=torch.float64)
    v, w, r, c = mixer._controls(u, K, None)
    z_ref, s_ref = naive_spectral_scan(v[:, None], w[:, None], r[:, None], c[:, None], *mixer._modal(K),
                                       initial_state=state, output_final_state=True)
    plan = mixer.decode_plan(K, torch.float64)
    consts = plan.consts
    h = u @ plan.w_in.T
    s = state.clone()
    z = dt.spectral_decode_step(h, s, consts, backend="torch")
    torch.testing.assert_close(z, z_ref[:, 0].reshape(B, -1) / K ** 0.5, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)


def test_fused_step_validates_shapes():
    consts = dt.ModalConstants(torch.rand(4, 9, 2), torch.rand(4), 4, 2, 3, 1e-6)
    with pytest.raises(ValueError, match="h must be"):
        dt.spectral_decode_step(torch.randn(1, 5), torch.zeros(1, 4, 2, 2, 3), consts)
    with pytest.raises(ValueError, match="state must be"):
        dt.spectral_decode_step(torch.randn(1, 36), torch.zeros(1, 4, 2, 2, 4), consts)
    with pytest.raises(ValueError, match="decode backend"):
        resolve_decode_backend("cuda", torch.device("cpu"))


_INTERPRETER_CHECK = """
import torch
from elastic_ssm.ops import gemv as ns
from elastic_ssm.ops.spectral_scan import decode_triton as dt
for B, K, M, P in [(1, 4, 8, 28), (3, 5, 3, 64)]:
    table = torch.randn(K, 9, M)
    table[:, 3] = torch.rand(K, M)
    c = dt.ModalConstants(table, torch.rand(K), K, M, P, 1e-6)
    h, s = torch.randn(B, K * (P + 3 * M)), torch.randn(B, K, M, 2, P)
    s2 = s.clone()
    torch.testing.assert_close(dt.spectral_decode_step(h, s2, c, backend="triton"),
                               dt.spectral_step_torch(h, s, c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s, rtol=1e-5, atol=1e-5)
x, w = torch.randn(3, 100), torch.randn(100)
torch.testing.assert_close(ns.rms_norm(x, w, 1e-6, "triton"), ns.rms_norm(x, w, 1e-6, "torch"))
hh = torch.randn(2, 2 * 1500)
torch.testing.assert_close(ns.swiglu(hh, "triton"), ns.swiglu(hh, "torch"), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_triton_kernels_in_interpreter():
    """The Triton kernels on CPU tensors (TRITON_INTERPRET=1 must be set before triton is imported)."""
    run_interpreted(_INTERPRETER_CHECK)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("tier", ["T3", None])
@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_fast_decoder_equals_model_step(dtype, tol, tier, attention):
    model, B = _perturbed(dtype), 3
    V = model.config.vocab_size
    ids = torch.randint(0, V, (B, 20))     # longer than the window (16): the ring wraps
    ref_cache = model.allocate_cache(B, tier, state_dtype=dtype, kv_dtype=dtype)
    with torch.no_grad():
        model(ids, tier=tier, cache=ref_cache)
    fd = FastDecoder(model, tier, B, cache=copy.deepcopy(ref_cache), backend="torch", attention=attention)
    tok = torch.randint(0, V, (B,))
    for _ in range(10):
        ref = model.step(tok, ref_cache)
        assert _rel(fd.step(tok), ref) < tol
        tok = ref.argmax(-1)
    torch.testing.assert_close(fd.cache.positions, ref_cache.positions)
    for i, s in ref_cache.states.items():
        torch.testing.assert_close(fd.cache.states[i], s, rtol=tol * 10, atol=tol * 10)


def test_fast_decoder_rejects_foreign_cache():
    model = _perturbed(torch.float32)
    cache = model.allocate_cache(2, "T1")
    with pytest.raises(ValueError, match="allocate it with"):
        FastDecoder(model, "T3", 2, cache=cache)
    with pytest.raises(ValueError, match="tokens must be integer ids of shape"):
        FastDecoder(model, "T1", 2, cache=cache).step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="CUDA"):
        FastDecoder(model, "T1", 2, cache=cache).capture()


def test_transformer_decode_equals_forward():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, d_ff=48, head_dim=8)
    model = TransformerPP(cfg).double().eval()
    ids = torch.randint(0, 64, (2, 14))
    with torch.no_grad():
        full = model(ids)
    cache = model.allocate_cache(2, 16)
    with torch.no_grad():
        prompt_logits = model(ids[:, :9], cache=cache)
    torch.testing.assert_close(prompt_logits, full[:, :9])
    for t in range(9, 14):
        torch.testing.assert_close(model.step(ids[:, t], cache), full[:, t], rtol=1e-10, atol=1e-10)
    assert sum(p.numel() for p in model.parameters()) == es.elastic.num_parameters(cfg)


def test_table54_matching_and_counts():
    tcfg, info = transformer_matched(es.ESSHConfig.preset("1.5b"))
    assert (tcfg.d_ff, tcfg.n_layers, tcfg.d_model, tcfg.vocab_size) == (4672, 28, 2048, 128256)
    assert round(info["params"] / 1e6, 1) == 1536.3 and abs(info["gap"] - 0.0034) < 1e-4   # Table 54
    with torch.device("meta"):
        model = TransformerPP(tcfg)
    assert sum(p.numel() for p in model.parameters()) == es.elastic.num_parameters(tcfg) == info["params"]
    d_ff, p, gap = match_ffn_width(1000, lambda f: 10 * f + 7, 8)
    assert (d_ff, p) == (96, 967) and gap == pytest.approx(-0.033)


def test_cast_matrices_keeps_modal_tables_wide():
    model = cast_matrices(_perturbed(torch.float32), torch.bfloat16)
    mixer = model.blocks[0].mixer
    assert mixer.in_proj.weight.dtype == mixer.out_proj.weight.dtype == model.embed.weight.dtype == torch.bfloat16
    assert mixer.theta.dtype == mixer.gate_bias.dtype == model.norm_f.weight.dtype == torch.float32
    assert model.blocks[1].mixer.qkv.weight.dtype == model.blocks[1].ffn.w_in.weight.dtype == torch.bfloat16


def test_bench_end_to_end_tiny(tmp_path):
    out, docs = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    cfg = BenchConfig(preset="tiny", tiers=("T1", "T10"), batches=(1, 2), warmup=1, iters=2,
                      prefill_lengths=(32,), prefill_warmup=1, prefill_iters=1, train_batch=2,
                      train_seq_len=32, train_warmup=1, train_steps=1, generate_tiers=("T1", "T10"),
                      generate_prompt=24, generate_new_tokens=5, generate_iters=1,
                      peers=("transformer", "gated_deltanet"), out=str(out), docs=str(docs), device="cpu")
    logs = []
    res = run_bench(cfg, log=logs.append)
    saved = json.loads(out.read_text())
    assert saved["config"]["preset"] == "tiny" and saved["env"]["torch"] == torch.__version__
    dec = {(r["model"], r.get("tier"), r["batch"], r["mode"]): r for r in res["decode"]}
    for key in [("essh", "T1", 1, "eager"), ("essh", "T10", 2, "eager"), ("transformer", "-", 1, "eager")]:
        assert dec[key]["ms"] > 0 and dec[key]["state_bytes_per_seq"] > 0
    assert {r["peer"] for r in res["ratios"]} >= {"transformer", "essh-unfused"}
    assert res["train"][0]["tok_s"] > 0 and 0 < res["train"][0]["mfu"] < 1
    assert res["prefill"][0]["ktok_s"] > 0
    gen = {r["tier"]: r for r in res["generate"]}
    for row in gen.values():   # the user's generate path, with the pooled decoder's step beside it (wall-clock
        # values on a shared CPU are noisy: only their presence and the derived fields are checked)
        assert row["prefill_ms"] > 0 and row["total_ms"] > 0 and row["step_ms"] > 0 and "error" not in row
        assert row["ms_per_token"] == pytest.approx((row["total_ms"] - row["prefill_ms"]) / 4)
        assert row["ratio"] == pytest.approx(row["ms_per_token"] / row["step_ms"]) and not row["graphed"]
    assert set(gen) == {"T1", "T10"}
    gdn = [r for r in res["decode"] if r["model"] == "gated_deltanet"]
    assert gdn and ("error" in gdn[0] or "params" in gdn[0])
    text = docs.read_text()
    assert text.startswith("# Benchmarks") and "## decode" in text and "## generate" in text and "commit" in text
    assert any("decode" in line for line in logs)


def test_bench_cli_and_validation(tmp_path):
    res = main(["--bench.preset", "tiny", "--bench.benchmarks", "decode", "--bench.tiers", "T1", "--bench.batches", "1",
                "--bench.warmup", "0", "--bench.iters", "1", "--bench.no_reference", "--bench.peers",
                "transformer", "--bench.out", str(tmp_path / "d.json")])
    assert [(r["model"], r["mode"]) for r in res["decode"]] == [("essh", "eager"), ("transformer", "build"),
                                                                 ("transformer", "eager")]
    assert (tmp_path / "d.json").exists() and res["prefill"] == []
    with pytest.raises(es.ConfigError, match="benchmarks"):
        BenchConfig(benchmarks=("speed",))
    with pytest.raises(es.ConfigError, match="compile_mode"):
        BenchConfig(compile=True, compile_mode="fast")
    with pytest.raises(es.ConfigError, match="tiers"):
        bad = BenchConfig(preset="tiny", tiers=("T99",), benchmarks=("decode",), out="")
        run_bench(bad, log=lambda s: None)


def test_compiled_bench_compiles_transformer_peer_too(tmp_path):
    """With ``compile`` the Transformer++ peer is compiled like ESSH (a fair ratio), and every row says so."""
    cfg = BenchConfig(preset="tiny", benchmarks=("train", "prefill"), tiers=("T10",), prefill_tiers=("T10",),
                      prefill_lengths=(32,), prefill_warmup=1, prefill_iters=1, train_batch=2, train_seq_len=32,
                      train_warmup=1, train_steps=1, train_peers=True, peers=("transformer",), compile=True,
                      out="", device="cpu")
    res = run_bench(cfg, log=lambda s: None)
    rows = [r for r in res["train"] + res["prefill"] if r.get("length", 1)]
    assert {(r["bench"], r["model"]) for r in rows} == {("train", "essh"), ("train", "transformer"),
                                                       ("prefill", "essh"), ("prefill", "transformer")}
    for r in rows:
        assert "error" not in r, r
        assert r["compiled"] is True, r
    assert all(r["tok_s"] > 0 for r in res["train"]) and all(r["ktok_s"] > 0 for r in rows if r["bench"] == "prefill")


def test_out_of_memory_is_a_row_result_and_other_errors_propagate():
    from elastic_ssm.bench.decode import oom_as_result

    row: dict = {}
    with oom_as_result(row, torch.device("cpu"), peak=True):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert row == {"error": "OOM"}
    row = {}
    with pytest.raises(ValueError, match="bad shape"):
        with oom_as_result(row, torch.device("cpu")):
            raise ValueError("bad shape")
    assert "error" not in row


def test_serve_bench_drives_a_real_server_process_on_the_cpu(tmp_path):
    pytest.importorskip("fastapi")
    cfg = BenchConfig(preset="tiny", benchmarks=("serve",), serve_mixes=("T1,T10",), serve_streams=(5,),
                      serve_slots=2, serve_prompt=5, serve_new_tokens=6, serve_rounds=1, serve_client_procs=1,
                      out="", device="cpu")
    res = run_bench(cfg, log=lambda s: None)
    assert [r["mix"] for r in res["serve"]] == ["T1,T10"]
    for row in res["serve"]:   # 3 streams at T1 through 2 slots: one waits in the queue, every token arrives
        assert "error" not in row, row
        assert row["tokens"] == 5 * 6 and row["tok_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
        assert row["itl_p50_ms"] > 0


def test_environment_names_the_scan_backend_the_run_used(monkeypatch):
    from elastic_ssm.utils.environment import environment

    monkeypatch.delenv("ELASTIC_SSM_SCAN_BACKEND", raising=False)
    assert environment(torch.device("cpu"))["scan_backend"] == "torch"      # auto on CPU
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "naive")
    assert environment(torch.device("cpu"))["scan_backend"] == "naive"
    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "bogus")
    assert environment(torch.device("cpu"))["scan_backend"].startswith("unusable (unknown spectral-scan backend")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_cpu_splits_the_http_process_from_its_engine_child():
    """``_tree_cpu`` (the serve rows' ``http_cpu`` / ``server_cpu``): a child that burned 0.3 s of CPU counts in the
    total, not in the parent's own seconds."""
    import subprocess

    from elastic_ssm.bench.serve import _tree_cpu

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 20
        while _tree_cpu(child.pid)[0] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        own, total = _tree_cpu(os.getpid())
        assert own >= 0 and total - own >= 0.28, (own, total)
    finally:
        child.kill()
        child.wait()


def test_only_repeatable_list_flags_add_up():
    """``--bench.set`` / ``--bench.only`` given twice keep both lists; another list flag given twice keeps the last,
    as argparse does (``--bench.serve_streams 1 --bench.serve_streams 128`` is 128)."""
    ns = parse("bench", ["--bench.set", "a=1", "b=2", "--bench.set", "c=3", "--bench.only", "x",
                         "--bench.only", "y", "--bench.serve_streams", "1", "--bench.serve_streams", "128"])
    got = overrides(ns, "bench")
    assert got["set"] == ("a=1", "b=2", "c=3") and got["only"] == ("x", "y") and got["serve_streams"] == (128,)


@pytest.mark.parametrize("cls,fields,message", [
    ("BenchConfig", {"compile_mode": "fast"}, "BenchConfig.compile_mode: Input should be 'default'"),
    ("BenchConfig", {"serve_streams": [0]},
     "BenchConfig.serve_streams[0]: Input should be greater than or equal to 1, got 0"),
    ("BenchConfig", {"serve_prefill_wait_ms": [float("inf")]},
     "serve_prefill_wait_ms[0]: Input should be a finite number"),
    ("BenchConfig", {"generate_new_tokens": 1},
     "BenchConfig.generate_new_tokens: Input should be greater than or equal to 2, got 1"),
    ("SessionPrefillOptions", {"scan_backends": ["x"]}, "scan_backends[0]: Input should be 'auto', 'fla' or 'torch'"),
    ("SessionPrefillOptions", {"lengths": []}, "SessionPrefillOptions.lengths: Tuple should have at least 1 item"),
    ("FirstTokenOptions", {"runs": -1}, "FirstTokenOptions.runs: Input should be greater than or equal to 0, got -1"),
    ("GeneratePathsOptions", {"threads": 0},
     "GeneratePathsOptions.threads: Input should be greater than or equal to 1, got 0"),
])
def test_bench_options_are_checked_by_their_declared_types(cls, fields, message):
    """Choices and ranges are declared on the fields (Literal, AtLeast1, ...): pydantic names the field in one line."""
    from benchmarks.first_token import FirstTokenOptions
    from benchmarks.generate_paths import GeneratePathsOptions, SessionPrefillOptions

    options = {"BenchConfig": BenchConfig, "SessionPrefillOptions": SessionPrefillOptions,
               "FirstTokenOptions": FirstTokenOptions, "GeneratePathsOptions": GeneratePathsOptions}[cls]
    with pytest.raises(es.ConfigError) as err:
        options.from_dict(fields)
    assert message in str(err.value) and "\n" not in str(err.value)
