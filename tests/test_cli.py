"""The command line and the main job on a tiny configuration (the real quickstart is the README command)."""

import csv
import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import ESSHConfig, tier_table
from elastic_ssm.cli import main

TINY_RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: capacity_mixed, steps: 3, micro_batch_size: 2, grad_accum: 4, seq_len: 32,
        mixing: {n_warm_tokens: 64}, ordering: {every: 2}, eval: {every: 0, batches: 2}, checkpoint: {every: 2},
        log_every: 1,
        refine: {steps: 2, tokens_per_step: 128}}
data: {source: stdlib, tokenizer: bytes, max_train_bytes: 200000}
"""


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("qs")
    (root / "tiny.yaml").write_text(TINY_RUN)
    assert main(["quickstart", "--out", str(root / "out"), "--config", str(root / "tiny.yaml")]) == 0
    return root


def test_quickstart_writes_report_table_plot_and_exports(quick):
    out = quick / "out"
    rows = list(csv.DictReader(open(out / "tiers.csv")))
    assert [r["tier"] for r in rows] == [f"T{i}" for i in range(1, 11)]
    assert all(r["export_check"] == "bitwise" for r in rows)
    report = (out / "report.md").read_text()
    assert "Tier curve monotone" in report and "Dense control" in report
    # the dense control as the paper runs it: truncated and recovered with the same refinement, raw beside it
    assert "truncated to each tier and recovered" in report and "(raw, before recovery)" in report
    assert (out / "dense" / "refine" / "step_0000002").is_dir() and (out / "elastic" / "refine").is_dir()
    assert (out / "quality_size.png").stat().st_size > 1000
    assert (out / "exports" / "T1" / "model.safetensors").is_file()
    bpb = float(rows[0]["bpb"])
    assert f"| held-out bits per byte (quickstart validation) | {bpb:.4f} |" in (out / "exports" / "T1" /
                                                                                "README.md").read_text()
    assert (out / "elastic" / "final" / "config.json").is_file()


def test_quickstart_names_where_the_tier_curve_is_not_monotone():
    from elastic_ssm.eval.perplexity import TierEval
    from elastic_ssm.quickstart import _inversions

    def row(tier, loss):
        return TierEval(tier=tier, K=1, n_ff=1, params=1, loss=loss, tokens=16384, bytes_per_token=1.0)

    rows = [row("T1", 2.5), row("T2", 2.0), row("T3", 2.0000022), row("T4", 1.9)]
    assert _inversions(rows) == f"T3 {rows[2].bpb - rows[1].bpb:.2g} bpb above T2"
    assert _inversions(rows[:2]) == ""


def test_export_eval_generate_on_the_trained_model(quick, tmp_path, capsys):
    final = str(quick / "out" / "elastic" / "final")
    assert main(["export", final, "--tiers", "T2,T5", "--out", str(tmp_path / "ex"), "--check_len", "16"]) == 0
    assert "T5: OK" in capsys.readouterr().out
    csv_path = tmp_path / "e.csv"
    assert main(["eval", final, "--tiers", "T1,T10", "--seq_len", "32", "--batch_size", "2", "--n_batches", "2",
                 "--csv", str(csv_path), "--write_quality"]) == 0
    rows = list(csv.DictReader(open(csv_path)))
    assert [r["tier"] for r in rows] == ["T1", "T10"] and all(float(r["bpb"]) > 0 for r in rows)
    quality = json.loads((quick / "out" / "elastic" / "final" / "tier_quality.json").read_text())
    assert quality["metric"] == "bpb" and quality["data"] == "stdlib" and not quality["higher_is_better"]
    assert {t: q["value"] for t, q in quality["tiers"].items()} == {r["tier"]: float(r["bpb"]) for r in rows}
    capsys.readouterr()
    assert main(["generate", final, "--tier", "T3", "--prompt", "def ", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    t3 = tier_table(ESSHConfig.preset("tiny"))[2].params
    assert main(["generate", final, "--tier", "auto", "--max_params", str(t3), "--prompt", "x",
                 "--max_new_tokens", "2"]) == 0
    assert "--tier auto: T3" in capsys.readouterr().err


def test_train_resume_and_overrides(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(TINY_RUN)
    out = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--train.out_dir", str(out), "--train.steps", "2",
            "--model.d_ff", "128"]
    assert main(args) == 0
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["config"]["d_ff"] == 128
    assert (out / "run.yaml").is_file() and (out / "metrics.jsonl").is_file()
    assert main([*args[:-2], "--resume"]) == 2                    # model changed: refused, nothing lost
    assert main([*args, "--train.steps", "3", "--resume"]) == 2      # schedule changed: refused
    assert main([*args, "--resume"]) == 0                            # same run: continues from its checkpoint
    steps = [json.loads(line).get("step") for line in open(out / "metrics.jsonl")]
    assert max(s for s in steps if s is not None) == 2


def test_prepare_and_tokenizer(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello elastic world\n" * 200)
    assert main(["prepare", str(text), str(tmp_path / "t.bin")]) == 0
    assert (tmp_path / "t.bin").stat().st_size == 2 * len(text.read_bytes()) + 2
    assert main(["tokenizer", "train", str(text), "--vocab_size", "300", "--out", str(tmp_path / "tok.json")]) == 0
    assert (tmp_path / "tok.json").is_file()


def test_tokenizer_train_never_replaces_a_file_that_is_no_tokenizer(tmp_path, capsys):
    """``--overwrite`` replaces an earlier tokenizer.json, never another file (a model's config.json was replaced by a
    tokenizer, so the model no longer loaded); a vocabulary the BPE trainer cannot hold is one line (it aborted the
    process with a Rust out-of-memory backtrace)."""
    text = tmp_path / "corpus.txt"
    text.write_text("hello elastic world\n" * 200)
    es_model = tmp_path / "m"
    import elastic_ssm as es

    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(es_model)
    saved = (es_model / "config.json").read_bytes()
    train = ["tokenizer", "train", str(text), "--vocab_size", "300", "--quiet"]
    capsys.readouterr()
    assert main([*train, "--out", str(es_model / "config.json"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a tokenizer.json" in err[0] and "choose another path" in err[0], err
    assert (es_model / "config.json").read_bytes() == saved
    es.ESSH.from_pretrained(es_model)
    assert main([*train[:3], "--vocab_size", str(10**11), "--out", str(tmp_path / "big.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab_size=100,000,000,000 is too large" in err[0], err
    assert not (tmp_path / "big.json").exists()


def test_a_failed_cpu_allocation_says_out_of_memory_and_what_to_shrink(capsys):
    """torch's CPU allocator raises a RuntimeError ("[enforce fail at alloc_cpu.cpp:127] err == 0.
    DefaultCPUAllocator: ..."), as ``generate --max_new_tokens 1e14`` or ``export --check_len 1e8`` met it: one
    line saying out of memory and which flags make the work smaller, not the allocator's internals."""
    from elastic_ssm.cli_util import run_reporting_errors

    assert run_reporting_errors(lambda: torch.empty(1 << 62, dtype=torch.uint8), "generate", False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory (the CPU could not allocate 4,611,686,018,427,387,904 bytes)" in err[0]
    assert "--max_new_tokens" in err[0] and "enforce fail" not in err[0], err


def test_info_and_clear_errors(tmp_path, capsys):
    assert main(["info"]) == 0
    assert "scan backends" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {arch: essh, preset: tiny, d_model: 63}\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "divisible by n_channels" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_train_help_lists_derived_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--train.mixing.full_share" in out and "--model.n_modes" in out and "--data.source" in out
    assert "--train.refine.steps" in out and "--train.full_share" not in out   # old flat names: not flags


def test_python_resume_refuses_a_different_model(tmp_path):
    import elastic_ssm as es
    from elastic_ssm.train import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(8)]
    cfg = TrainConfig(steps=2, micro_batch_size=2, seq_len=16, checkpoint={"every": 1}, eval={"every": 0},
                      out_dir=str(tmp_path), recipe="dense")
    train(es.ESSHConfig.preset("tiny"), batches, cfg, progress=False, distributed=False)
    before = sorted(p.name for p in (tmp_path / "pretrain").iterdir())
    with pytest.raises(ValueError, match="different config"):
        train(es.ESSHConfig.preset("tiny", d_ff=128), batches, cfg, resume=True, progress=False, distributed=False)
    assert sorted(p.name for p in (tmp_path / "pretrain").iterdir()) == before     # nothing deleted


def test_bench_command_passes_its_flags_to_the_harness(tmp_path, capsys):
    """``elastic-ssm bench --bench.*``: the harness's flags reach its parser (they start with '-', which an
    argparse remainder does not take first) and the command exits 0; here the decode benchmark on CPU."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--bench.device", "cpu", "--bench.benchmarks", "decode", "--bench.preset", "tiny",
            "--bench.tiers", "T1", "T10", "--bench.batches", "1", "--bench.warmup", "0", "--bench.iters", "1",
            "--bench.no_reference", "--bench.peers", "transformer", "--bench.out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["decode"]
    assert {r["model"] for r in rows} == {"essh", "transformer"}
    assert [r["tier"] for r in rows if r["model"] == "essh"] == ["T1", "T10"] and all(r["ms"] > 0 for r in rows
                                                                                     if r["mode"] == "eager")
    assert main(["--debug", *argv]) == 0
    with pytest.raises(SystemExit):            # the harness's own help, not the top-level parser's error
        main(["bench", "--help"])
    assert "--bench.generate_new_tokens" in capsys.readouterr().out


def test_an_error_while_generate_streams_starts_its_own_line(tmp_path, capsys, monkeypatch):
    """The streamed text had no newline before the error, so a terminal showed "hielastic-ssm generate: error"."""
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path / "m")

    def failing(self, ids, n, *, streamer, **kwargs):
        streamer(ids[:, :1])
        raise RuntimeError("the device went away")

    monkeypatch.setattr(es.ESSH, "generate", failing)
    assert main(["generate", str(tmp_path / "m"), "--prompt", "hi", "--max_new_tokens", "4"]) != 0
    out, err = capsys.readouterr()
    assert out.startswith("hi") and out.endswith("\n")
    assert "the device went away" in err.strip().splitlines()[-1]


def test_a_prompt_beyond_an_es_ssm_filter_is_refused_before_it_is_echoed(tmp_path, capsys):
    """A 200-byte prompt to an ES-SSM of filter length 128 was printed, then refused with advice to rebuild the
    model; it is now one line naming --prompt before any output (decoding past the filter length still runs)."""
    es.ESSSM(es.ESSSMConfig.preset("tiny")).save_pretrained(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "a" * 200, "--max_new_tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--prompt is 200 tokens, more than the 128" in err
    assert main(["generate", str(tmp_path / "m"), "--prompt", "a" * 120, "--max_new_tokens", "20"]) == 0


def test_train_refuses_a_file_as_out_dir_before_loading_data(tmp_path, capsys, monkeypatch):
    """It was refused only after the data was loaded (minutes for a large corpus)."""
    import elastic_ssm.pipeline

    def loading(*args, **kwargs):
        raise AssertionError("the data was loaded before the --train.out_dir check")

    monkeypatch.setattr(elastic_ssm.pipeline, "build_data", loading)
    (tmp_path / "a_file").write_text("mine")
    assert main(["train", "--model.preset", "tiny", "--train.out_dir", str(tmp_path / "a_file")]) == 2
    assert "a_file is a file; give a folder" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "mine"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_help_into_a_closed_pipe_stops_quietly(argv):
    """`elastic-ssm --help | head -1`: the reader has gone; no traceback, no error line, exit 141 (SIGPIPE's)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)                               # the reader is gone before the first write
    try:
        r = subprocess.run([sys.executable, "-m", "elastic_ssm.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_bench_without_a_suite_or_a_gpu_says_what_to_run(monkeypatch, capsys):
    """Without CUDA the default bench (370m and peers, 131k prefills) would run for hours on the CPU: refused,
    naming the CPU suite; --bench.device cpu still runs it (test_bench_command_passes_its_flags_to_the_harness)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err and "--bench.suite cpu-smoke" in err


def test_a_list_flag_given_with_commas_says_to_use_spaces(tmp_path, capsys):
    """tyro takes a list flag as separate values; `0.5,1.0` got only "Could not find valid parse"."""
    argv = ["train", "--model.preset", "tiny", "--train.out_dir", str(tmp_path / "r"), "--train.mixing.capacities"]
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "0.5,1.0"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith("give the values separated by spaces, not commas: --train.mixing.capacities 0.5 1.0 "
                        "(see elastic-ssm train --help)")
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "0.5", "x"])
    assert "commas" not in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag,value,says", [("--train.steps", "1.5", "'1.5' is not a whole number"),
                                             ("--train.steps", "1e3", "'1e3' is not a whole number"),
                                             ("--train.optim.lr", "abc", "'abc' is not a number")])
def test_a_value_of_the_wrong_type_is_named_in_plain_words(tmp_path, capsys, flag, value, says):
    """Python's own parse errors ("invalid literal for int() with base 10") reached the user as they were."""
    with pytest.raises(SystemExit, match="2"):
        main(["train", "--train.out_dir", str(tmp_path / "r"), flag, value])
    err = capsys.readouterr().err.strip()
    assert err == f"elastic-ssm train: error: {flag}: {says} (see elastic-ssm train --help)"
