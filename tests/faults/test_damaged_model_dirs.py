"""Saved model directories damaged or edited the way users do: every load is refused with an error naming the
file and the problem (``CheckpointError`` in Python, one line and exit code 2 on the command line), never a
model that runs on wrong weights or tokens, and nothing saved is changed."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import elastic_ssm as es
from elastic_ssm.cli import main
from elastic_ssm.models import CheckpointError
from elastic_ssm.serve.select import tier_choice

CHECKSUM_KEYS = ("weights_bytes", "weights_sha256", "weights_sha256_pieces")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny ESSH (byte tokenizer) saved by ``save_pretrained``."""
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.tokenizer = es.data.load_tokenizer("bytes")
    return model.save_pretrained(tmp_path_factory.mktemp("saved") / "model")


def _copy(saved, tmp_path, name="model"):
    return shutil.copytree(saved, tmp_path / name)


def _edit_config(d, edit):
    meta = json.loads((d / "config.json").read_text())
    edit(meta)
    (d / "config.json").write_text(json.dumps(meta))


def _resave_weights(d, edit):
    """Rewrite ``model.safetensors`` with ``edit`` applied to its tensors, as a user re-saving the weights would:
    the size and checksums in config.json then describe the old file, so they are dropped too."""
    state = load_file(d / "model.safetensors")
    edit(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(d, lambda meta: [meta.pop(k, None) for k in CHECKSUM_KEYS])


def _one_line(capsys, *words):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    for word in words:
        assert word in err[0], (word, err[0])


@pytest.mark.parametrize("tier", [None, "T1", "T4"])
def test_a_tensor_of_another_shape_is_refused_at_every_tier(saved, tmp_path, capsys, tier):
    """A tier reads only a prefix of each elastic tensor: a saved tensor one row too long must still be refused,
    not cut to the tier's rows and run."""
    d = _copy(saved, tmp_path)
    name = "blocks.0.ffn.w_in.weight"
    _resave_weights(d, lambda s: s.update({name: torch.zeros(s[name].shape[0] + 1, s[name].shape[1])}))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor {name} has shape"):
        es.models.load_pretrained(d, tier=tier)
    if tier is not None:
        assert main(["generate", str(d), "--tier", tier, "--prompt", "a", "--max_new_tokens", "1"]) == 2
        _one_line(capsys, str(d / "model.safetensors"), name, "(385, 64)", "384")


RECORD_EDITS = {  # name: (edit of config.json, words of the error)
    "source a list": (lambda m: m.update(source=[1]), ["'source' holds list", "an object"]),
    "tokenizer record a string": (lambda m: m.update(tokenizer="bytes"), ["'tokenizer' holds str", "an object"]),
    "weights_bytes a string": (lambda m: m.update(weights_bytes="12"), ["'weights_bytes' holds str", "an integer"]),
    "checksum a number": (lambda m: m.update(weights_sha256=5), ["'weights_sha256' holds int", "a string"]),
    "piece digests without a size": (lambda m: m["weights_sha256_pieces"].pop("piece_bytes"),
                                     ["'weights_sha256_pieces'", "piece_bytes"]),
    "a newer format": (lambda m: m.update(format_version=99), ["format version 99", "upgrade elastic_ssm"]),
}


@pytest.mark.parametrize("case", list(RECORD_EDITS))
def test_config_json_keys_of_the_wrong_type_name_the_key(saved, tmp_path, capsys, case):
    """The keys beside the model config that loading reads (source, tokenizer record, weights' size and digests,
    format version): another JSON type was a KeyError / TypeError / AttributeError reported as a bug, or went
    unnoticed."""
    edit, words = RECORD_EDITS[case]
    d = _copy(saved, tmp_path)
    _edit_config(d, edit)
    with pytest.raises(CheckpointError, match=words[0]):
        es.models.load_pretrained(d)
    assert main(["generate", str(d), "--prompt", "a", "--max_new_tokens", "1"]) == 2
    _one_line(capsys, str(d / "config.json"), *words)


@pytest.fixture(scope="module")
def bpe_saved(tmp_path_factory):
    """A tiny ESSH saved with a small BPE tokenizer (its special tokens named in tokenizer_config.json)."""
    import dataclasses

    from elastic_ssm.data.corpora import iter_documents

    root = tmp_path_factory.mktemp("bpe")
    docs = [d for _, d in zip(range(6), iter_documents("stdlib"))]
    tok = es.data.train_bpe(docs, 300, root / "tok" / "tokenizer.json")
    torch.manual_seed(0)
    model = es.ESSH(dataclasses.replace(es.ESSHConfig.preset("tiny"), vocab_size=tok.vocab_size))
    model.tokenizer = tok
    return model.save_pretrained(root / "model")


@pytest.mark.parametrize("case", ["not json", "eos renamed"])
def test_a_damaged_tokenizer_config_is_named(bpe_saved, tmp_path, capsys, case):
    """tokenizer_config.json names the special tokens; the fingerprint covers tokenizer.json only. Corrupt, it was
    a bare JSONDecodeError naming no file; edited (eos named as pad), the model loaded with another eos id."""
    d = _copy(bpe_saved, tmp_path)
    cfg = d / "tokenizer_config.json"
    if case == "not json":
        cfg.write_text("{not json")
        words = [str(cfg), "not valid JSON"]
    else:
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "eos_token": "<pad>"}))
        words = ["eos 2 -> 0", "tokenizer_config.json was edited"]
    with pytest.raises(ValueError, match=words[1]):
        es.models.load_pretrained(d)
    assert main(["generate", str(d), "--prompt", "a", "--max_new_tokens", "1"]) == 2
    _one_line(capsys, *words)


def test_an_integer_tensor_where_weights_belong_names_the_file(saved, tmp_path, capsys):
    """torch's own copy error named neither the file nor what to do (several lines in Python)."""
    d = _copy(saved, tmp_path)
    name = "blocks.0.ffn.w_in.weight"
    _resave_weights(d, lambda s: s.update({name: s[name].to(torch.int32)}))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor {name} is torch.int32"):
        es.models.load_pretrained(d)
    assert main(["eval", str(d), "--seq_len", "8", "--n_batches", "1", "--batch_size", "1"]) == 2
    _one_line(capsys, str(d / "model.safetensors"), name, "torch.int32")


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_the_missing_tokenizer_file_is_the_one_named(saved, bpe_saved, tmp_path, capsys, which):
    """A byte model reads elastic_tokenizer.json, a BPE model tokenizer.json. Without its file, a byte model
    loaded the transformers tokenizer.json and was refused as 'replaced'; a BPE model's error said the folder
    holds neither file though elastic_tokenizer.json was there. Now each names the file that is missing."""
    d = _copy(saved if which == "bytes" else bpe_saved, tmp_path)
    missing = "elastic_tokenizer.json" if which == "bytes" else "tokenizer.json"
    (d / missing).unlink()
    assert main(["generate", str(d), "--prompt", "x", "--max_new_tokens", "2"]) == 2
    _one_line(capsys, f"{d / missing} is missing", f"{which} tokenizer", "restore it")


def test_a_run_or_checkpoint_given_as_the_model_names_the_model_inside(saved, tmp_path, capsys):
    """A training run, one of its checkpoints, or an unfinished run given where the model directory belongs: the
    error names the model directory inside it (it gave the generic '<out_dir>/final' hint); of an unfinished run's
    checkpoints, the newest complete one (a save cut short has no COMPLETE.json)."""
    run = tmp_path / "run"
    shutil.copytree(saved, run / "pretrain" / "step_0000002" / "model")
    (run / "pretrain" / "step_0000002" / "COMPLETE.json").write_text("{}")
    shutil.copytree(saved, run / "pretrain" / "step_0000003" / "model")     # a save cut short: no COMPLETE.json
    cases = [(run, "an unfinished training run; its newest complete checkpoint's model is "
              f"{run / 'pretrain' / 'step_0000002' / 'model'}"),
             (run / "pretrain" / "step_0000002", f"a training checkpoint; its model is "
              f"{run / 'pretrain' / 'step_0000002' / 'model'}")]
    for given, words in cases:
        assert main(["generate", str(given), "--prompt", "x", "--max_new_tokens", "2"]) == 2
        _one_line(capsys, f"{given} has no config.json: it is {words}")
    shutil.copytree(saved, run / "final")
    assert main(["eval", str(run), "--device", "cpu"]) == 2
    _one_line(capsys, f"{run} has no config.json: it is a training run; its model is {run / 'final'}")


def test_a_tensor_of_another_float_dtype_names_the_tensor(saved, tmp_path):
    """One float16 tensor among float32 ones loaded as saved, and the first forward failed in a matmul naming no
    file. Converting on load (dtype=, the command line's --dtype) makes them one dtype, and a bfloat16 model's
    float32 tensors (``keep_fp32``, as ``from_pretrained(dtype=torch.bfloat16)`` leaves them and
    ``save_pretrained`` writes them) are no fault."""
    d = _copy(saved, tmp_path)
    name = "blocks.1.ffn.w_out.weight"
    _resave_weights(d, lambda s: s.update({name: s[name].half()}))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor {name} is torch.float16 while the model's "
                                              "other weights are torch.float32"):
        es.models.load_pretrained(d)
    assert main(["generate", str(d), "--prompt", "a", "--max_new_tokens", "1"]) == 0   # --dtype auto converts
    converted = es.models.load_pretrained(d, dtype=torch.float32)
    assert {p.dtype for p in converted.parameters()} == {torch.float32}
    half = es.models.load_pretrained(saved, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16, torch.float32}
    again = es.models.load_pretrained(half.save_pretrained(tmp_path / "bf16"))
    assert {k: v.dtype for k, v in again.state_dict().items()} == {k: v.dtype for k, v in half.state_dict().items()}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_with_nan_or_inf_name_the_tensor(saved, tmp_path, capsys, value):
    """A diverged run saved with valid checksums (or bytes changed in a directory without them) loaded and generated
    garbage; it is refused naming the tensor, at every tier that reads it."""
    model = es.models.load_pretrained(saved)
    name = "blocks.0.ffn.w_in.weight"
    with torch.no_grad():
        model.get_parameter(name)[0, 0] = value
    d = model.save_pretrained(tmp_path / "diverged")
    for tier in (None, "T1"):
        with pytest.raises(CheckpointError, match=f"tensor {name} holds NaN or infinite values"):
            es.models.load_pretrained(d, tier=tier)
    assert main(["generate", str(d), "--prompt", "a", "--max_new_tokens", "1"]) == 2
    _one_line(capsys, str(d / "model.safetensors"), name, "earlier checkpoint")


@pytest.mark.parametrize("field, value", [("d_model", 10**12), ("n_layers", 10**9)])
def test_a_config_sized_beyond_its_weights_is_refused_before_the_model_is_built(saved, tmp_path, capsys, field, value):
    """A ``config.json`` edited to sizes its weights cannot fill was built first: d_model 1e12 overflowed torch
    ("Storage size calculation overflowed"), n_layers 1e9 built layers past any timeout. Now one line naming it."""
    d = _copy(saved, tmp_path)
    _edit_config(d, lambda m: m["config"].update({field: value}))
    with pytest.raises(CheckpointError, match="its model config needs .* parameters but .* holds 173,264 values"):
        es.models.load_pretrained(d)
    assert main(["generate", str(d), "--prompt", "a", "--max_new_tokens", "1"]) == 2
    _one_line(capsys, str(d / "config.json"), "save the model again")


@pytest.mark.parametrize("damage", ["missing", "folder"])
def test_weights_missing_or_a_folder_say_so_and_what_to_do(saved, tmp_path, capsys, damage):
    """It was "<dir>: missing model.safetensors" for both, with nothing to do."""
    d = _copy(saved, tmp_path)
    (d / "model.safetensors").unlink()
    if damage == "folder":
        (d / "model.safetensors").mkdir()
    assert main(["generate", str(d), "--prompt", "hi", "--max_new_tokens", "1"]) == 2
    said = "is a folder, not the weights file" if damage == "folder" else "model.safetensors is missing"
    _one_line(capsys, str(d), said, "copy the whole directory again")


@pytest.mark.parametrize("row", [5, {"ms_per_token": "x"}, {"ms_per_token": {"1": "fast"}},
                                 {"ms_per_token": {"one": 2.0}}, {"params": 1}])
def test_a_damaged_tier_profile_row_names_the_file_and_the_tier(saved, tmp_path, capsys, row):
    """A ``tier_profile.json`` row edited or damaged is a one-line error naming the file, the tier and the
    calibrate command (``serve --tier auto`` said "unexpected AttributeError ... probably a bug" or an ``int()`` /
    ``float()`` message naming no file)."""
    d = _copy(saved, tmp_path)
    good = {"ms_per_token": {"1": 1.0}, "state_bytes": 1, "params": 1}
    (d / "tier_profile.json").write_text(json.dumps({"device": "cpu", "tiers": {"T1": good, "T2": row}}))
    before = (d / "tier_profile.json").read_bytes()
    with pytest.raises(ValueError, match="tier 'T2' has no ms_per_token table"):
        es.select_tier(d, max_ms_per_token=5.0)
    assert main(["serve", str(d), "--device", "cpu", "--port", "0", "--tier", "auto", "--max_ms_per_token", "5"]) == 2
    _one_line(capsys, str(d / "tier_profile.json"), "'T2'", f"elastic-ssm calibrate {d} --tiers T2")
    assert (d / "tier_profile.json").read_bytes() == before


def test_a_tier_quality_row_without_a_value_is_unscored(saved, tmp_path):
    """A ``tier_quality.json`` row that is a mapping without ``value`` is a tier it does not score (said in the
    choice's line), not a KeyError."""
    d = _copy(saved, tmp_path)
    (d / "tier_quality.json").write_text(json.dumps({"metric": "bpb", "tiers": {"T1": {"x": 1}, "T2": {"value": 1}}}))
    choice = tier_choice(d, max_params=10**12)
    assert choice.tier.name == "T10" and "tier_quality.json does not score" in choice.line()
