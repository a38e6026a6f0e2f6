"""Bad input, table-driven: every case of the command line exits with code 2 and one line that names the
problem (never a traceback); ``--debug`` shows the traceback. The model-level cases raise a ValueError
that names the argument."""

import json
import warnings

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main

TINY = "model: {arch: essh, preset: tiny}\ntrain: {steps: 2, micro_batch_size: 2, seq_len: 16, eval_batches: 1}\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The inputs the cases refer to, by name: YAML files, corpora, tokenizers, a saved model."""
    root = tmp_path_factory.mktemp("bad")
    text = root / "corpus.txt"
    text.write_text("hello elastic world, a small corpus\n" * 400)
    w = {"corpus": text, "empty": root / "empty.txt", "tok": root / "tokenizer.json", "file": root / "a_file",
         "prep": root / "prep", "model": root / "model"}
    w["empty"].write_text("")
    w["tok"].write_text("{not json")
    w["file"].write_text("x")
    w["prep"].mkdir()
    (w["prep"] / "README.md").write_text("notes about this data\n" * 50)
    assert main(["prepare", str(text), str(w["prep"] / "validation.bin")]) == 0
    for name, body in {"good": TINY, "train5": "train: 5\n", "model_str": "model: tiny\n",
                       "preset_key": "model: {preset: tiny, colour: red}\n", "syntax": "model: {preset: tiny\n",
                       "steps_bool": "model: {preset: tiny}\ntrain: {steps: true}\n", "list": "- 1\n- 2\n",
                       "section": "model: {preset: tiny}\nextra: {a: 1}\n",
                       "train_preset": "model: {preset: tiny}\ntrain: {preset: 7b}\n"}.items():
        (root / f"{name}.yaml").write_text(body)
        w[name] = root / f"{name}.yaml"
    torch.manual_seed(0)
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(w["model"])
    return root, w


TRAIN = ["train", "--config", "{good}", "--data.source", "{corpus}", "--train.out_dir", "{root}/out"]
EVAL = ["eval", "{model}", "--data", "{corpus}", "--seq-len", "16", "--batch-size", "1", "--batches", "1"]
CASES = {  # name: (argv, words the message must contain)
    "yaml section not a mapping": (["train", "--config", "{train5}"], ["TrainConfig", "mapping"]),
    "model is a string": (["train", "--config", "{model_str}"], ["model", "mapping"]),
    "unknown key beside preset": (["train", "--config", "{preset_key}"], ["colour", "preset"]),
    "yaml syntax": (["train", "--config", "{syntax}"], ["invalid YAML", "line"]),
    "yaml is a list": (["train", "--config", "{list}"], ["mapping"]),
    "unknown section": (["train", "--config", "{section}"], ["extra"]),
    "steps: true": (["train", "--config", "{steps_bool}"], ["steps", "boolean"]),
    "config missing": (["train", "--config", "{root}/nope.yaml"], ["nope.yaml", "does not exist"]),
    "lr 1/0": ([*TRAIN, "--train.lr", "1/0"], ["--train.lr", "1/0"]),
    "lr inf": ([*TRAIN, "--train.lr", "inf"], ["lr", "finite"]),
    "lr nan": ([*TRAIN, "--train.lr", "nan"], ["lr", "finite"]),
    "steps 0": ([*TRAIN, "--train.steps", "0"], ["steps", ">= 1"]),
    "uneven token batch": ([*TRAIN, "--train.tokens_per_step", "100"], ["tokens_per_step", "multiple"]),
    "token batch and grad_accum": ([*TRAIN, "--train.tokens_per_step", "64", "--train.grad_accum", "2"],
                                   ["grad_accum", "tokens_per_step"]),
    "unknown train preset": (["train", "--config", "{train_preset}"], ["preset", "7b"]),
    "precision fp16": ([*TRAIN, "--train.precision", "fp16"], ["precision", "fp16"]),
    "batch 0": ([*TRAIN, "--train.micro_batch_size", "0"], ["micro_batch_size", ">= 1"]),
    "seq_len 0": ([*TRAIN, "--train.seq_len", "0"], ["seq_len", ">= 1"]),
    "negative bytes_per_token": ([*TRAIN, "--train.bytes_per_token", "-1"], ["bytes_per_token"]),
    "unknown flag": ([*TRAIN, "--train.colour", "red"], ["--train.colour"]),
    "bad eval tier": ([*TRAIN, "--train.eval.tiers", "T99"], ["eval.tiers", "T99"]),
    "lr 0 (nested flag)": ([*TRAIN, "--train.optim.lr", "0"], ["OptimConfig.lr", "> 0"]),
    "corrupt tokenizer": ([*TRAIN, "--data.tokenizer", "{tok}"], ["tokenizer.json", "not a valid"]),
    "missing tokenizer": ([*TRAIN, "--data.tokenizer", "{root}/none.json"], ["none.json"]),
    "prepared folder without train.bin": ([*TRAIN, "--data.source", "{prep}"], ["train.bin", "prepare"]),
    "empty source": ([*TRAIN, "--data.source", "{empty}"], ["empty.txt", "no text"]),
    "missing source": ([*TRAIN, "--data.source", "{root}/absent"], ["absent"]),
    "out_dir is a file": ([*TRAIN[:-1], "{file}"], ["a_file", "is a file"]),
    "out_dir under a file": ([*TRAIN[:-1], "{file}/run"], ["a_file"]),
    "resume and overwrite": ([*TRAIN, "--resume", "--overwrite"], ["--resume", "--overwrite"]),
    "vocab too small": ([*TRAIN, "--model.vocab_size", "100"], ["vocab_size"]),
    "export check-len 0": (["export", "{model}", "--out", "{root}/ex", "--check-len", "0"], ["--check-len"]),
    "export unknown tier": (["export", "{model}", "--out", "{root}/ex", "--tier", "T99"], ["T99"]),
    "eval batch-size 0": ([*EVAL, "--batch-size", "0"], ["--batch-size", ">= 1"]),
    "eval seq-len 0": ([*EVAL, "--seq-len", "0"], ["--seq-len", ">= 1"]),
    "eval batches 0": ([*EVAL, "--batches", "0"], ["--batches"]),
    "eval negative bytes-per-token": ([*EVAL, "--bytes-per-token", "-2"], ["--bytes-per-token"]),
    "eval infinite bytes-per-token": ([*EVAL, "--bytes-per-token", "inf"], ["--bytes-per-token"]),
    "eval empty token file": ([*EVAL[:3], "{empty}", *EVAL[4:]], ["empty.txt", "no text"]),
    "eval unknown tier": ([*EVAL, "--tiers", "T99"], ["T99"]),
    "eval capacity fraction 0": ([*EVAL, "--tiers", "T1,0"], ["--tiers 0", "(0, 1]"]),
    "eval capacity fraction above 1": ([*EVAL, "--tiers", "1.5"], ["--tiers 1.5", "(0, 1]"]),
    "eval capacity fraction negative": ([*EVAL, "--tiers", "-0.2"], ["--tiers -0.2", "(0, 1]"]),
    "eval capacity fraction nan": ([*EVAL, "--tiers", "nan"], ["--tiers nan", "(0, 1]"]),
    "eval tier neither name nor number": ([*EVAL, "--tiers", "0.3,big"], ["'big'", "(0, 1]"]),
    "eval lengths not a number": ([*EVAL, "--lengths", "1x,two"], ["--lengths", "two"]),
    "eval lengths 2x without a run": ([*EVAL, "--lengths", "1x,2x"], ["--lengths", "--train-len"]),
    "eval train-len 0": ([*EVAL, "--lengths", "2x", "--train-len", "0"], ["--train-len", ">= 1"]),
    "importance first 0": (["importance", "{model}", "--first", "0"], ["--first", ">= 1"]),
    "importance unknown tier": (["importance", "{model}", "--tier", "T99", "--out", "{root}/imp"], ["T99"]),
    "importance out is a file": (["importance", "{model}", "--out", "{file}"], ["--out", "is a file"]),
    "eval missing model": (["eval", "{root}/nomodel"], ["nomodel", "config.json"]),
    "eval model is a file": (["eval", "{file}"], ["a_file"]),
    "generate empty prompt": (["generate", "{model}", "--prompt", ""], ["--prompt", "empty"]),
    "generate unknown tier": (["generate", "{model}", "--prompt", "a", "--tier", "T99"], ["T99"]),
    "generate top-p above 1": (["generate", "{model}", "--prompt", "a", "--top-p", "1.5"], ["top_p", "(0, 1]"]),
    "generate negative top-k": (["generate", "{model}", "--prompt", "a", "--top-k", "-2"], ["top_k", ">= 0"]),
    "niah context 0": (["niah", "{model}", "--context", "0"], ["--context"]),
    "niah depths not numbers": (["niah", "{model}", "--depths", "0.1,abc"], ["--depths", "abc"]),
    "eval csv folder missing": ([*EVAL, "--csv", "{root}/no/such/dir/x.csv"], ["--csv", "does not exist"]),
    "export out is a file": (["export", "{model}", "--out", "{file}"], ["--out", "is a file"]),
    "prepare empty source": (["prepare", "{empty}", "{root}/e.bin"], ["empty.txt", "no tokens"]),
    "tokenizer vocab 0": (["tokenizer", "train", "{corpus}", "--vocab-size", "0", "--out", "{root}/t.json"],
                          ["--vocab-size"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_code_2(files, case, capsys):
    root, w = files
    argv, words = CASES[case]
    argv = [a.format(root=root, **w) for a in argv]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own errors (unknown flag, unparsable value) exit from the parser
            rc = e.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and "/s]" not in line]  # not progress bars
    assert rc == 2, (case, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_debug_shows_the_traceback(files, monkeypatch):
    root, w = files
    with pytest.raises(Exception, match="mapping"):
        main(["--debug", "train", "--config", str(w["train5"])])
    monkeypatch.setenv("ELASTIC_SSM_DEBUG", "1")
    with pytest.raises(Exception, match="mapping"):
        main(["train", "--config", str(w["train5"])])


@pytest.mark.parametrize("make,match", [
    (lambda: dict(input_ids=torch.zeros(0, 8, dtype=torch.long)), "0 rows"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(1, 8)), r"\[B, T\]"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 7)), r"\[B, T\]"),
    (lambda: dict(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(8)), "never broadcast"),
    (lambda: dict(input_ids=torch.full((1, 4), 999)), "vocab_size"),
    (lambda: dict(input_ids=torch.zeros(1, 4)), "integer"),
])
def test_model_inputs_are_checked(make, match):
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(ValueError, match=match):
        model(**make())


def test_config_json_of_a_saved_model_carries_the_checksum(files):
    _, w = files
    meta = json.loads((w["model"] / "config.json").read_text())
    assert len(meta["weights_sha256"]) == 64


def test_an_unreachable_hub_is_one_line_in_seconds(files, capsys, monkeypatch):
    """An ``hf:`` source without network fails at once (a TCP check of ``HF_ENDPOINT``: here a closed local
    port), not after the hub client's retries, with the fix in the message; ``HF_DATASETS_OFFLINE=1`` skips
    the check and leaves the cache lookup to ``datasets``."""
    import socket

    from elastic_ssm.data.corpora import _check_hub_reachable

    with socket.socket() as s:                   # a port nobody listens on: connecting is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    root, _ = files
    assert main(["prepare", "hf:someone/corpus", str(root / "hf.bin")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "/s]" not in line]
    assert len(err) == 1 and "cannot be reached" in err[0] and f"127.0.0.1:{port}" in err[0], err
    assert "HF_DATASETS_OFFLINE=1" in err[0] and "Traceback" not in err[0]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _check_hub_reachable("hf:someone/corpus")    # the user asked for the local cache: no check, no error
