"""The command line derived from dataclasses by tyro: every flag has help and one spelling (a near miss is named
in the error), a flag is named as typed in errors, ``--help`` shows the defaults a run really uses,
``--version``, ``configs/tiny.yaml`` trains, and under torchrun only rank 0 prints status and input errors."""

import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml

import elastic_ssm as es
from elastic_ssm import cli_schema
from elastic_ssm.cli import COMMANDS, main, parse

ROOT = Path(__file__).resolve().parents[1]
WITH_OPTIONS = {name: cls for name, (_, cls, _) in COMMANDS.items() if cls is not None}


def _argv(cmd: str, cls: type) -> list[str]:
    """The smallest command line of ``cmd``: its positionals and required flags, each a placeholder."""
    out = [cmd]
    for f in dataclasses.fields(cls):
        if f.metadata.get("metavar"):
            out.append(f"pos_{f.name}")
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and not f.metadata.get("metavar"):
            out += ["--" + f.name, "x"]
    return out


def test_every_option_has_help_and_every_command_parses_its_defaults():
    for cmd, cls in WITH_OPTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
        opts = parse(cmd, _argv(cmd, cls)[1:])
        for f in dataclasses.fields(cls):   # an absent flag is the field's default
            if f.default is not dataclasses.MISSING:
                assert getattr(opts, f.name) == f.default, (cmd, f.name)


def test_one_spelling_per_flag_and_a_near_miss_names_it(capsys):
    """No hidden aliases (issue 38: one spelling for every flag): an older spelling is refused in one line that
    names the flag to give."""
    assert not any("aliases" in f.metadata for cls in WITH_OPTIONS.values() for f in dataclasses.fields(cls))
    for argv, flag in ((["eval", "m", "--batches", "2"], "--n_batches"), (["niah", "m", "--pairs", "2"], "--n_pairs"),
                       (["niah", "m", "--context", "64"], "--context_len"),
                       (["export", "m", "--tier", "T1"], "--tiers")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == f"elastic-ssm {argv[0]}: error: unrecognized arguments: {argv[2]}; did you mean {flag}?", err


def test_an_error_names_the_flag_as_typed(capsys):
    assert main(["niah", "m", "--n-pairs", "0"]) == 2
    assert "--n-pairs: Input should be greater than or equal to 1, got 0" in capsys.readouterr().err
    assert main(["niah", "m", "--n_pairs", "0"]) == 2
    assert "--n_pairs: Input should be greater than or equal to 1, got 0" in capsys.readouterr().err


def test_a_seed_out_of_its_generators_range_names_the_flag(capsys):
    """``generate --seed 1e24`` said "Overflow when unpacking long long" after loading the model, ``niah --seed -1``
    numpy's "expected non-negative integer": neither named the flag. Both are refused before the verb runs."""
    assert main(["generate", "m", "--prompt", "a", "--seed", str(10**24)]) == 2
    assert f"--seed: Input should be less than or equal to {(1 << 64) - 1}, got {10**24}" in capsys.readouterr().err
    assert main(["niah", "m", "--seed", "-1"]) == 2
    assert "--seed: Input should be greater than or equal to 0, got -1" in capsys.readouterr().err


def test_an_abbreviated_flag_is_an_error_not_another_setting(capsys):
    assert parse("train", ["--train.steps", "5"]).train.steps == 5
    for argv in (["train", "--train.st", "5"], ["serve", "m", "--max_batc", "4"], ["eval", "m", "--tier", "T1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "unrecognized arguments: " + argv[-2] in capsys.readouterr().err


def test_boolean_flags_of_options_and_sections_in_every_spelling():
    assert parse("train", ["--train.compile"]).train.compile is True
    for flag in ("--train.no_compile", "--train.no-compile", "--no-train.compile"):
        args = parse("train", ["--train.compile", flag])
        assert args.train.compile is False and "train.compile" in args._given, flag
    for flag in ("--no_prefill_graphs", "--no-prefill-graphs", "--no-prefill_graphs"):
        assert parse("serve", ["m", flag]).prefill_graphs is False, flag
    assert parse("serve", ["m"]).prefill_graphs is True


def test_recover_protocols_are_the_trainers():
    from elastic_ssm.train.recover import PROTOCOLS

    hints = typing.get_type_hints(cli_schema.RecoverOptions)
    assert typing.get_args(hints["protocol"]) == PROTOCOLS


def test_options_and_the_help_of_model_commands_import_no_torch():
    """Parsing loads no model code: the commands' functions are imported when they run."""
    code = ("import sys, contextlib, io, elastic_ssm.cli_schema\nfrom elastic_ssm.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['eval', '--help'])\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_import_elastic_ssm_loads_no_cli_and_no_parser_library():
    code = ("import elastic_ssm, sys; print([m for m in sys.modules if m.startswith(('tyro', 'jsonargparse', "
            "'elastic_ssm.cli', 'fastapi', 'uvicorn', 'elastic_ssm.serve'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_helper_processes_get_their_options_through_the_derived_flags():
    """A parent writes a child's options dataclass as flags (``to_argv``); the child's ``derive`` reads back the
    same options: no hand-written flag list on either side."""
    from benchmarks.ddp_check import DdpCheckOptions
    from benchmarks.first_token import ChildOptions
    from benchmarks.serve_proxy import ProxyOptions
    from benchmarks.serve_stub import ExperimentServerOptions, StubServerOptions
    from elastic_ssm.bench.serve import BenchServerOptions
    from elastic_ssm.cli_util import derive, to_argv

    for opts in (ChildOptions(mode="import-fla", spawned_at=1.25), ChildOptions(model="/m", cprofile="p.txt"),
                 BenchServerOptions(tiers="T1,T10", port=9, prefill_graphs=False),
                 StubServerOptions(tiers="T1,T10", stub_step_ms=2.0, engine="thread", switch_interval=0.001),
                 DdpCheckOptions(seq_len=32, precision="bf16"),
                 ProxyOptions(server=ExperimentServerOptions(max_prefill=8, loop="asyncio"))):
        assert derive(type(opts), to_argv(opts), "child") == opts


def test_every_verb_help_shows_defaults(capsys):
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert f"elastic-ssm {cmd}" in text and (cmd == "info" or "(default: " in text)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"elastic-ssm {es.__version__}"


def _help_of(text: str, flag: str) -> str:
    """The help paragraph of ``flag`` in a tyro --help text (box borders dropped), whitespace collapsed."""
    text = "\n".join(line.strip("│").rstrip() for line in text.splitlines())     # a flag at column 1, help below
    block = re.search(rf"^ {{1,2}}{re.escape(flag)}[ ,].*?(?=^ {{1,2}}-)", text, re.S | re.M).group(0)
    return " ".join(block.split())


def test_train_help_shows_the_values_a_bare_run_uses(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    run = yaml.safe_load(cli_schema.DEFAULT_RUN.read_text())
    assert f"(default: {run['train']['steps']})" in _help_of(text, "--train.steps")
    assert f"(default: {run['train']['seq_len']})" in _help_of(text, "--train.seq_len")
    assert f"(default: {run['model']['preset']})" in _help_of(text, "--model.preset")
    d_model = es.ESSHConfig.preset(run["model"]["preset"]).d_model
    assert f"(default: {d_model})" in _help_of(text, "--model.d_model")
    assert cli_schema.DEFAULT_RUN.name in text


def test_the_tiny_run_file_trains(tmp_path):
    """``configs/tiny.yaml`` (every YAML there loads: ``test_config.py``), two steps of it."""
    out = tmp_path / "tiny"
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--train.steps", "2",
                 "--train.tokens_per_step", "512", "--train.eval.batches", "1", "--data.max_train_bytes", "100000",
                 "--train.out_dir", str(out)]) == 0
    steps = [json.loads(line).get("step") for line in open(out / "metrics.jsonl")]
    assert max(s for s in steps if s is not None) >= 2 and (out / "final" / "config.json").is_file()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "m"
    torch.manual_seed(0)
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(path)
    return path


@pytest.mark.parametrize("rank", ["0", "1"])
def test_status_and_input_errors_come_from_rank_zero(saved, rank, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["generate", str(saved), "--tier", "T2", "--prompt", "a", "--max_new_tokens", "2", "--device", "cpu"]
    assert main(argv) == 0
    announced = "generate: cpu (CPU)" in capsys.readouterr().err
    assert announced == (rank == "0")
    assert main(["niah", str(saved), "--context_len", "0"]) == 2           # the same mistake on every rank
    err = capsys.readouterr().err
    assert ("--context_len: Input should be greater than or equal to 1, got 0" in err) == (rank == "0")
    assert err.count("\n") <= 1
    with pytest.raises(SystemExit) as e:                                     # tyro's own error
        main(["eval", str(saved), "--no-such-flag"])
    assert e.value.code == 2 and ("--no-such-flag" in capsys.readouterr().err) == (rank == "0")
    assert main(["eval", str(saved / "config.json")]) == 2    # an error of this rank's own: each rank, numbered
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"(rank {rank})" in err[0]
