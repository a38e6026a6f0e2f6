"""Bad input, table-driven: every case of the command line exits with code 2 and one line that names the
problem (never a traceback); ``--debug`` shows the traceback. The Python API's arguments
(``export_tier``, ``from_pretrained``, ``select_tier``) raise an error that names them; bad tensor input to a
model is ``test_bad_model_inputs.py``."""

import json
import socket
import warnings

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.models import CheckpointError

TINY = "model: {arch: essh, preset: tiny}\ntrain: {steps: 2, micro_batch_size: 2, seq_len: 16, eval: {batches: 1}}\n"


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
    w["old_csv"] = root / "old.csv"
    w["old_csv"].write_text("a table of mine\n")
    w["old_rec"] = root / "old_rec"
    w["old_rec"].mkdir()
    (w["old_rec"] / "recovery.csv").write_text("an earlier recovery\n")
    (w["prep"] / "README.md").write_text("notes about this data\n" * 50)
    assert main(["prepare", str(text), str(w["prep"] / "validation.bin")]) == 0
    for name, body in {"good": TINY, "train5": "train: 5\n", "model_str": "model: tiny\n",
                       "preset_key": "model: {preset: tiny, colour: red}\n", "syntax": "model: {preset: tiny\n",
                       "steps_bool": "model: {preset: tiny}\ntrain: {steps: true}\n", "list": "- 1\n- 2\n",
                       "section": "model: {preset: tiny}\nextra: {a: 1}\n",
                       "train_preset": "model: {preset: tiny}\ntrain: {preset: 7b}\n",
                       "optim_scalar": "model: {preset: tiny}\ntrain: {optim: 5}\n",
                       "optim_unknown": "model: {preset: tiny}\ntrain: {optim: {lr: 1e-3, colour: red}}\n",
                       "flat_and_section": "model: {preset: tiny}\ntrain: {lr: 1e-3, optim: {lr: 2e-3}}\n",
                       "dup_key": "model: {preset: tiny}\nmodel: {preset: small}\n", "blank": "# nothing\n",
                       "preset_int": "model: {preset: 5}\n",
                       "eval_null": "model: {preset: tiny}\ntrain: {eval: null}\n",
                       "cuda7": "model: {preset: tiny}\ntrain: {device: 'cuda:7'}\n"}.items():
        (root / f"{name}.yaml").write_text(body)
        w[name] = root / f"{name}.yaml"
    torch.manual_seed(0)
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(w["model"])
    from elastic_ssm.config import model_config_from_dict
    from elastic_ssm.models import build_model

    for arch in ("transformer", "matformer", "es_ssm"):     # a small ES-SSM accepts at most seq_len=128 tokens
        spec = {"arch": arch, "preset": "tiny", **({"seq_len": 128} if arch == "es_ssm" else {})}
        w[arch] = root / arch
        build_model(model_config_from_dict(spec), seed=0).save_pretrained(w[arch])
    es_ssm = es.ESSSM(es.ESSSMConfig.preset("tiny"))       # K-bar 8, budgets (2, 4, 8)
    w["es"], w["es_k4"] = root / "es", root / "es_k4"
    es_ssm.save_pretrained(w["es"])
    es.export_tier(es_ssm, 4).save_pretrained(w["es_k4"])   # K-bar 4
    w["cfg_list"] = root / "cfg_list"
    w["cfg_list"].mkdir()
    (w["cfg_list"] / "config.json").write_text("[1, 2]")
    w["cfg_field"] = root / "cfg_field"
    w["cfg_field"].mkdir()
    meta = json.loads((w["model"] / "config.json").read_text())
    meta["config"]["d_model"] = "wide"
    (w["cfg_field"] / "config.json").write_text(json.dumps(meta))
    w["busy_port"] = socket.socket()
    w["busy_port"].bind(("127.0.0.1", 0))
    w["busy_port"].listen()
    w["port"] = str(w["busy_port"].getsockname()[1])
    yield root, w
    w["busy_port"].close()


TRAIN = ["train", "--config", "{good}", "--data.source", "{corpus}", "--train.out_dir", "{root}/out"]
EVAL = ["eval", "{model}", "--data", "{corpus}", "--seq_len", "16", "--batch_size", "1", "--n_batches", "1"]
CASES = {  # name: (argv, words the message must contain)
    "yaml section not a mapping": (["train", "--config", "{train5}"], ["TrainConfig", "mapping"]),
    "model is a string": (["train", "--config", "{model_str}"], ["model", "mapping"]),
    "unknown key beside preset": (["train", "--config", "{preset_key}"], ["colour", "preset"]),
    "yaml syntax": (["train", "--config", "{syntax}"], ["invalid YAML", "line"]),
    "yaml is a list": (["train", "--config", "{list}"], ["mapping"]),
    "unknown section": (["train", "--config", "{section}"], ["extra"]),
    "steps: true": (["train", "--config", "{steps_bool}"], ["steps", "boolean"]),
    "config missing": (["train", "--config", "{root}/nope.yaml"], ["nope.yaml", "does not exist"]),
    "config twice": ([*TRAIN, "--config={root}/nope.yaml"], ["--config", "more than once"]),
    "lr 1/0": ([*TRAIN, "--train.optim.lr", "1/0"], ["--train.optim.lr", "1/0"]),
    "lr inf": ([*TRAIN, "--train.optim.lr", "inf"], ["lr", "finite"]),
    "lr nan": ([*TRAIN, "--train.optim.lr", "nan"], ["lr", "finite"]),
    "steps 0": ([*TRAIN, "--train.steps", "0"], ["steps", "greater than or equal to 1"]),
    "seed beyond 64 bits": ([*TRAIN, "--train.seed", str(1 << 64)], ["TrainConfig.seed", "18446744073709551615"]),
    "uneven token batch": ([*TRAIN, "--train.tokens_per_step", "100"], ["tokens_per_step", "multiple"]),
    "token batch and grad_accum": ([*TRAIN, "--train.tokens_per_step", "64", "--train.grad_accum", "2"],
                                   ["grad_accum", "tokens_per_step"]),
    "unknown train preset": (["train", "--config", "{train_preset}"], ["preset", "7b"]),
    "precision fp16": ([*TRAIN, "--train.precision", "fp16"], ["precision", "fp16"]),
    "batch 0": ([*TRAIN, "--train.micro_batch_size", "0"], ["micro_batch_size", "greater than or equal to 1"]),
    "seq_len 0": ([*TRAIN, "--train.seq_len", "0"], ["seq_len", "greater than or equal to 1"]),
    "negative bytes_per_token": ([*TRAIN, "--train.eval.bytes_per_token", "-1"], ["bytes_per_token"]),
    "unknown flag": ([*TRAIN, "--train.colour", "red"], ["--train.colour"]),
    "bad eval tier": ([*TRAIN, "--train.eval.tiers", "T99"], ["eval.tiers", "T99"]),
    "lr 0 (nested flag)": ([*TRAIN, "--train.optim.lr", "0"], ["OptimConfig.lr", "greater than 0"]),
    "corrupt tokenizer": ([*TRAIN, "--data.tokenizer", "{tok}"], ["tokenizer.json", "not a valid"]),
    "missing tokenizer": ([*TRAIN, "--data.tokenizer", "{root}/none.json"], ["none.json"]),
    "prepared folder without train.bin": ([*TRAIN, "--data.source", "{prep}"], ["train.bin", "prepare"]),
    "empty source": ([*TRAIN, "--data.source", "{empty}"], ["empty.txt", "no text"]),
    "missing source": ([*TRAIN, "--data.source", "{root}/absent"], ["absent"]),
    "out_dir is a file": ([*TRAIN[:-1], "{file}"], ["a_file", "is a file"]),
    "out_dir under a file": ([*TRAIN[:-1], "{file}/run"], ["a_file"]),
    "resume and overwrite": ([*TRAIN, "--resume", "--overwrite"], ["--resume", "--overwrite"]),
    "vocab too small": ([*TRAIN, "--model.vocab_size", "100"], ["vocab_size"]),
    "es_ssm seq_len above its filters": ([*TRAIN, "--model.arch", "es_ssm", "--train.seq_len", "256"],
                                         ["--train.seq_len 256", "--model.seq_len 128"]),
    "export check-len 0": (["export", "{model}", "--out", "{root}/ex", "--check_len", "0"], ["--check_len"]),
    "export check-len beyond 64 bits": (["export", "{model}", "--out", "{root}/ex", "--check_len", str(1 << 63)],
                                        ["--check_len", "64-bit integer"]),
    "export check-len above ES-SSM filters": (["export", "{es}", "--out", "{root}/ex", "--check_len", "256"],
                                              ["--check_len 256", "filter length 128", "--check_len 128 or less"]),
    "export unknown tier": (["export", "{model}", "--out", "{root}/ex", "--tiers", "T99"], ["T99"]),
    # tier words: an all-digit word is an ES-SSM budget in every verb (ESSH refuses it, naming its tiers)
    "export budget on ESSH": (["export", "{model}", "--out", "{root}/ex", "--tiers", "4"],
                              ["unknown tier 4 for ESSHConfig", "'T10'"]),
    "export budget above K-bar": (["export", "{es}", "--out", "{root}/ex", "--tiers", "K4,9"],
                                  ["unknown tier 9 for ESSSMConfig", "[1, 8]", "(8 or 'K8'"]),
    "generate budget above an export's K-bar": (["generate", "{es_k4}", "--prompt", "a", "--tier", "8"],
                                                ["unknown tier 8", "[1, 4] (4 or 'K4';"]),
    "serve budget on ESSH": (["serve", "{model}", "--tiers", "T1,4"], ["unknown tier 4 for ESSHConfig"]),
    "specialist budget above K-bar": (["train", "--model.arch", "es_ssm", "--model.preset", "tiny",
                                       "--model.tier_config", "9", "--train.out_dir", "{root}/spec"],
                                      ["model.tier_config", "unknown tier 9", "[1, 8]"]),
    "generate on a Transformer++": (["generate", "{transformer}", "--prompt", "a"],
                                    ["a 'transformer' model", "ESSH and ES-SSM"]),
    "eval batch-size 0": ([*EVAL, "--batch_size", "0"], ["--batch_size", "greater than or equal to 1"]),
    "eval seq-len 0": ([*EVAL, "--seq_len", "0"], ["--seq_len", "greater than or equal to 1"]),
    "eval batches 0": ([*EVAL, "--n_batches", "0"], ["--n_batches"]),
    "eval negative bytes-per-token": ([*EVAL, "--bytes_per_token", "-2"], ["--bytes_per_token"]),
    "eval infinite bytes-per-token": ([*EVAL, "--bytes_per_token", "inf"], ["--bytes_per_token"]),
    "eval empty token file": ([*EVAL[:3], "{empty}", *EVAL[4:]], ["empty.txt", "no text"]),
    "eval unknown tier": ([*EVAL, "--tiers", "T99"], ["T99"]),
    "eval capacity fraction 0": ([*EVAL, "--tiers", "T1,0"], ["--tiers 0", "(0, 1]"]),
    "eval capacity fraction above 1": ([*EVAL, "--tiers", "1.5"], ["--tiers 1.5", "(0, 1]"]),
    "eval capacity fraction negative": ([*EVAL, "--tiers", "-0.2"], ["--tiers -0.2", "(0, 1]"]),
    "eval capacity fraction nan": ([*EVAL, "--tiers", "nan"], ["--tiers nan", "(0, 1]"]),
    "eval tier neither name nor number": ([*EVAL, "--tiers", "0.3,big"], ["'big'", "(0, 1]"]),
    "eval lengths not a number": ([*EVAL, "--lengths", "1x,two"], ["--lengths", "two"]),
    "eval lengths 2x without a run": ([*EVAL, "--lengths", "1x,2x"], ["--lengths", "--train_len"]),
    "eval train-len 0": ([*EVAL, "--lengths", "2x", "--train_len", "0"],
                         ["--train_len", "greater than or equal to 1"]),
    "importance first 0": (["importance", "{model}", "--first", "0"], ["--first", "greater than or equal to 1"]),
    "importance unknown tier": (["importance", "{model}", "--tier", "T99", "--out", "{root}/imp"], ["T99"]),
    "importance tier all": (["importance", "{model}", "--tier", "all", "--out", "{root}/imp"], ["--tier all"]),
    "importance out is a file": (["importance", "{model}", "--out", "{file}"], ["--out", "is a file"]),
    "importance of a transformer": (["importance", "{transformer}", "--seq_len", "16", "--out", "{root}/imp-tf"],
                                    ["'transformer' model", "no spectral channels", "ESSH and ES-SSM"]),
    "importance of a matformer": (["importance", "{matformer}", "--seq_len", "16"],
                                  ["'matformer' model", "no spectral channels"]),
    "eval missing model": (["eval", "{root}/nomodel"], ["nomodel", "does not exist", "save_pretrained"]),
    "eval model is a file": (["eval", "{file}"], ["a_file"]),
    "generate empty prompt": (["generate", "{model}", "--prompt", ""], ["--prompt", "empty"]),
    "generate unknown tier": (["generate", "{model}", "--prompt", "a", "--tier", "T99"], ["T99"]),
    "generate top-p above 1": (["generate", "{model}", "--prompt", "a", "--top_p", "1.5"], ["top_p", "(0, 1]"]),
    "generate negative top-k": (["generate", "{model}", "--prompt", "a", "--top_k", "-2"], ["top_k", ">= 0"]),
    "niah context 0": (["niah", "{model}", "--context_len", "0"], ["--context_len"]),
    "niah depths not numbers": (["niah", "{model}", "--depths", "0.1,abc"], ["--depths", "abc"]),
    "eval csv folder missing": ([*EVAL, "--csv", "{root}/no/such/dir/x.csv"], ["--csv", "does not exist"]),
    "export out is a file": (["export", "{model}", "--out", "{file}"], ["--out", "is a file"]),
    "prepare empty source": (["prepare", "{empty}", "{root}/e.bin"], ["empty.txt", "no tokens"]),
    "tokenizer vocab 0": (["tokenizer", "train", "{corpus}", "--vocab_size", "0", "--out", "{root}/t.json"],
                          ["--vocab_size"]),
    # config files: nested sections, duplicate keys, empty files, names that are not strings
    "section given as a scalar": (["train", "--config", "{optim_scalar}"], ["TrainConfig.optim", "mapping"]),
    "unknown key in a section": (["train", "--config", "{optim_unknown}"], ["OptimConfig", "colour"]),
    "old flat name beside its section": (["train", "--config", "{flat_and_section}"],
                                         ["unknown field", "'lr'", "did you mean optim.lr?"]),
    "old flat flag beside its section flag": ([*TRAIN, "--train.lr", "1e-3", "--train.optim.lr", "2e-3"],
                                              ["unrecognized", "--train.lr", "did you mean --train.optim.lr"]),
    "yaml key twice": (["train", "--config", "{dup_key}"], ["'model'", "twice", "lines 1 and 2"]),
    "yaml empty": (["train", "--config", "{blank}"], ["blank.yaml", "is empty"]),
    "config path empty": (["train", "--config", ""], ["--config", "empty string"]),
    "config is a folder": (["train", "--config", "{prep}"], ["prep", "folder"]),
    "preset not a string": (["train", "--config", "{preset_int}"], ["ModelChoice.preset", "a valid string"]),
    "section null": (["train", "--config", "{eval_null}"], ["TrainConfig.eval", "mapping"]),
    "cuda:7 in the run file": (["train", "--config", "{cuda7}", "--data.source", "{corpus}", "--train.out_dir",
                                "{root}/c7"], ["train.device", "cuda:7"]),
    "device cuda:7": ([*TRAIN, "--train.device", "cuda:7"], ["train.device", "cuda:7"]),
    "data.source empty": ([*TRAIN, "--data.source", ""], ["DataConfig.source", "empty"]),
    "data.tokenizer empty": ([*TRAIN, "--data.tokenizer", ""], ["DataConfig.tokenizer", "empty"]),
    "max_train_bytes negative": ([*TRAIN, "--data.max_train_bytes", "-5"],
                                 ["max_train_bytes", "greater than or equal to 0"]),
    "norm_eps 0": ([*TRAIN, "--model.norm_eps", "0"], ["norm_eps", "greater than 0"]),
    "channel_exponent 0": ([*TRAIN, "--model.channel_exponent", "0"], ["channel_exponent", "greater than 0"]),
    "init_std negative": ([*TRAIN, "--model.init_std", "-1"], ["init_std", "greater than or equal to 0"]),
    "model dir is a file": (["export", "{file}", "--out", "{root}/ex"], ["a_file", "is a file"]),
    "model dir empty string": (["generate", "", "--prompt", "a"], ["MODEL_DIR", "empty"]),
    "config.json a list": (["eval", "{cfg_list}"], ["config.json", "not an elastic_ssm model record"]),
    "config.json bad field": (["eval", "{cfg_field}"], ["config.json", "d_model", "invalid"]),
    "eval device cuda:7": ([*EVAL, "--device", "cuda:7"], ["--device", "cuda:7"]),
    "eval device nonsense": ([*EVAL, "--device", "gpu0"], ["--device", "gpu0"]),
    "eval device cpu:0": ([*EVAL, "--device", "cpu:0"], ["--device", "cpu:0", "use cpu"]),
    # every option: empty strings, non-finite numbers, outputs that cannot be written (before any work)
    "eval data empty": ([*EVAL, "--data", ""], ["--data", "empty"]),
    "eval lengths empty": ([*EVAL, "--lengths", ""], ["--lengths", "empty"]),
    "eval csv is a folder": ([*EVAL, "--csv", "{prep}"], ["--csv", "folder"]),
    "eval csv below a file": ([*EVAL, "--csv", "{file}/x.csv"], ["--csv", "a_file is a file"]),
    "eval csv exists": ([*EVAL, "--csv", "{old_csv}"], ["--csv {old_csv} already exists", "--overwrite"]),
    "eval csv is the model's config": ([*EVAL, "--csv", "{model}/config.json", "--overwrite"],
                                       ["config.json", "not a .csv file", "even with --overwrite"]),
    "eval csv is a folder, overwrite": ([*EVAL, "--csv", "{prep}", "--overwrite"], ["--csv", "folder"]),
    "niah csv exists": (["niah", "{model}", "--csv", "{old_csv}"], ["--csv {old_csv} already exists", "--overwrite"]),
    "lm-eval csv exists": (["lm-eval", "{model}", "--tasks", "piqa", "--csv", "{old_csv}"],
                           ["--csv {old_csv} already exists", "--overwrite"]),
    "export out empty": (["export", "{model}", "--out", ""], ["--out", "empty"]),
    "export out below a file": (["export", "{model}", "--out", "{file}/x"], ["--out", "a_file is a file"]),
    "importance first above K": (["importance", "{model}", "--first", "99", "--out", "{root}/imp"],
                                 ["--first 99", "8 channels"]),
    "generate budget nan": (["generate", "{model}", "--prompt", "a", "--tier", "auto", "--max_ms_per_token", "nan"],
                            ["--max_ms_per_token", "finite"]),
    "niah depth above 1": (["niah", "{model}", "--depths", "0.5,1.5"], ["--depths", "[0, 1]"]),
    "niah context beyond es_ssm filters": (["niah", "{es_ssm}", "--data", "{corpus}", "--context_len", "128",
                                            "--n_pairs", "1"],
                                           ["--context_len 128", "133 tokens", "--context_len 123 or less"]),
    "niah context too short": (["niah", "{model}", "--data", "{corpus}", "--context_len", "8", "--n_pairs", "1"],
                               ["--context_len 8", "no room"]),
    "serve timeout 0": (["serve", "{model}", "--timeout", "0"], ["--timeout", "greater than 0"]),
    "serve port 70000": (["serve", "{model}", "--port", "70000"], ["--port", "65535"]),
    "serve port in use": (["serve", "{model}", "--port", "{port}"], ["--port {port}", "in use"]),
    "serve host unknown": (["serve", "{model}", "--host", "no.such.host.invalid"], ["--host", "resolve"]),
    "serve name with @": (["serve", "{model}", "--name", "a@b"], ["--name", "'@'"]),
    "serve prefill wait negative": (["serve", "{model}", "--prefill_wait_ms", "-5"],
                                    ["--prefill_wait_ms", "greater than or equal to 0"]),
    "serve prefill wait inf": (["serve", "{model}", "--prefill_wait_ms", "inf"], ["--prefill_wait_ms", "finite"]),
    "serve prefill tokens zero": (["serve", "{model}", "--max_prefill_tokens", "0"],
                                  ["--max_prefill_tokens", "greater than or equal to 1"]),
    "serve corrupt tokenizer": (["serve", "{model}", "--tokenizer", "{tok}"], ["tokenizer.json", "not a valid"]),
    "serve missing tokenizer": (["serve", "{model}", "--tokenizer", "{root}/none.json"], ["none.json"]),
    "lm-eval limit 0": (["lm-eval", "{model}", "--tasks", "piqa", "--limit", "0"], ["--limit", "greater than 0"]),
    "lm-eval fewshot -1": (["lm-eval", "{model}", "--tasks", "piqa", "--num_fewshot", "-1"], ["--num_fewshot"]),
    "lm-eval include path missing": (["lm-eval", "{model}", "--tasks", "x", "--include_path", "{root}/none"],
                                     ["--include_path", "not a folder"]),
    "prepare source empty": (["prepare", "", "{root}/e.bin"], ["SOURCE", "empty"]),
    "prepare out is a folder": (["prepare", "{corpus}", "{prep}"], ["OUT", "folder"]),
    "prepare out not .bin": (["prepare", "{corpus}", "{root}/tokens"], ["tokens", ".bin"]),
    "tokenizer empty source": (["tokenizer", "train", "{empty}", "--vocab_size", "300", "--out", "{root}/t.json"],
                               ["empty.txt", "no text"]),
    "recover masks above 1": (["recover", "{model}", "--protocol", "posthoc", "--masks", "0.5", "2", "--steps", "1",
                               "--train.out_dir", "{root}/rec"], ["--masks", "less than or equal to 1"]),
    "recover out_dir is a file": (["recover", "{model}", "--steps", "1", "--train.out_dir", "{file}"],
                                  ["a_file", "is a file"]),
    "recover earlier recovery.csv": (["recover", "{model}", "--steps", "1", "--train.out_dir", "{old_rec}"],
                                     ["recovery.csv already exists", "--overwrite"]),
    "quickstart out is a file": (["quickstart", "--out", "{file}"], ["--out", "is a file"]),
    # bench: suites, selections and outputs (checked before anything is measured)
    "bench suite is a folder": (["bench", "--bench.suite", "{prep}/"], ["prep", "is a folder"]),
    "bench only names nothing": (["bench", "--bench.suite", "cpu-smoke", "--bench.only", "nothing*"],
                                 ["--bench.only", "matches no entry"]),
    "bench set malformed": (["bench", "--bench.suite", "cpu-smoke", "--bench.set", "iters"],
                            ["--bench.set", "KEY=VALUE"]),
    "bench set bad YAML value": (["bench", "--bench.suite", "cpu-smoke", "--bench.set", "memory.iters=["],
                                 ["--bench.set memory.iters=[", "invalid YAML", "fix the syntax"]),
    "bench set without suite": (["bench", "--bench.set", "iters=3"], ["--bench.set", "--bench.suite"]),
    "bench device cuda:7": (["bench", "--bench.device", "cuda:7"], ["--bench.device", "cuda:7"]),
    "bench docs is a folder": (["bench", "--bench.device", "cpu", "--bench.docs", "{prep}"],
                               ["--bench.docs", "folder"]),
    "bench out_dir is a file": (["bench", "--bench.suite", "cpu-smoke", "--bench.out_dir", "{file}"],
                                ["--bench.out_dir", "is a file"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_code_2(files, case, capsys):
    root, w = files
    argv, words = CASES[case]
    argv = [a.format(root=root, **w) for a in argv]
    words = [x.format(**w) for x in words]
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


def test_python_api_arguments_are_checked(files):
    _, w = files
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(TypeError, match="export_tier needs an elastic_ssm model"):
        es.export_tier(str(w["model"]), "T1")
    with pytest.raises(TypeError, match="dtype"):
        es.ESSH.from_pretrained(w["model"], dtype="float16")
    with pytest.raises(TypeError, match="float8"):        # was loaded, then every forward failed in promotion
        es.ESSH.from_pretrained(w["model"], dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cuda:7"):
        es.ESSH.from_pretrained(w["model"], device="cuda:7")
    with pytest.raises(ValueError, match="'cpu:1': the CPU is one device"):     # not 'the file is corrupted'
        es.ESSH.from_pretrained(w["model"], device="cpu:1")
    for budget in (dict(max_state_bytes=float("nan")), dict(max_params=-1), dict(max_ms_per_token=float("nan"))):
        with pytest.raises(ValueError, match="positive number"):
            es.select_tier(model, **budget)
    with pytest.raises(ValueError, match="no tier fits"):
        es.select_tier(model, max_params=1)
    with pytest.raises(CheckpointError, match="does not exist"):
        es.select_tier(w["model"].parent / "nothing", max_params=10**9)


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
