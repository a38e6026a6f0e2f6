"""Model directories travel: the tokenizer inside (training final/, checkpoints, exports), file modes,
the model card of an export, and ``torch.export`` of the forward."""

import json
import os
import stat

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.cli import main
from elastic_ssm.data.corpora import iter_documents

BPE_RUN = """
model: {arch: essh, preset: tiny}
train: {recipe: dense, steps: 2, micro_batch_size: 2, grad_accum: 1, seq_len: 32, eval: {every: 0, batches: 1},
        checkpoint: {every: 2}, log_every: 1}
data: {source: stdlib, tokenizer: TOK, max_train_bytes: 60000}
"""


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A tiny BPE tokenizer trained here, and two training steps with it through ``elastic-ssm train``."""
    root = tmp_path_factory.mktemp("bpe")
    docs = [d for _, d in zip(range(12), iter_documents("stdlib"))]
    tok = data.train_bpe(docs, 300, root / "tok" / "tokenizer.json")
    (root / "run.yaml").write_text(BPE_RUN.replace("TOK", str(root / "tok" / "tokenizer.json")))
    assert main(["train", "--config", str(root / "run.yaml"), "--train.out_dir", str(root / "run")]) == 0
    return root, tok


def test_training_saves_the_tokenizer_and_takes_vocab_size_from_it(bpe_run):
    root, tok = bpe_run
    final = root / "run" / "final"
    meta = json.loads((final / "config.json").read_text())
    assert meta["config"]["vocab_size"] == tok.vocab_size == 300          # the tiny preset says 260
    assert meta["tokenizer"]["fingerprint"] == tok.sha256 and meta["eos_token_id"] == tok.eos_id
    assert meta["config"]["eos_token_id"] == tok.eos_id and meta["model_type"] == "essh"
    ckpt = next((root / "run").glob("**/step_*/model"))
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.relative_to(root): stat.S_IMODE(p.stat().st_mode) for p in (root / "run").rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o666 & ~mask}, modes            # weights, optimizer, tokenizer files alike
    for d in (final, ckpt):
        assert {"tokenizer.json", "tokenizer_config.json", "elastic_tokenizer.json"} <= {p.name for p in d.iterdir()}
        loaded = es.models.load_pretrained(d)
        assert loaded.tokenizer.sha256 == tok.sha256
    text = "def f(x):\n    return x  # é"
    assert data.load_tokenizer(final).encode(text) == tok.encode(text)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(final)
    assert hf_tok(text)["input_ids"] == tok.encode(text) and hf_tok.eos_token_id == tok.eos_id


def test_saving_over_another_models_directory_leaves_only_its_own_tokenizer(bpe_run, tmp_path, monkeypatch):
    """A model saved into a folder that held another model's tokenizer files left them there, so a later load (ours
    or AutoTokenizer) paired the new weights with the old tokenizer. Now they are removed or overwritten; a file
    that save_pretrained never writes stays."""
    import shutil

    from elastic_ssm.data import tokenizers

    root, _ = bpe_run
    for name in ("none", "bytes"):
        shutil.copytree(root / "run" / "final", tmp_path / name)
        (tmp_path / name / "notes.txt").write_text("mine")
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path / "none")          # a model with no tokenizer
    assert not [p.name for p in (tmp_path / "none").iterdir() if "tokenizer" in p.name]
    assert es.models.load_pretrained(tmp_path / "none").tokenizer is None

    def missing():
        raise ImportError("no tokenizers")

    monkeypatch.setattr(tokenizers, "_import_tokenizers", missing)       # bytes then write elastic_tokenizer.json only
    byte_model = es.ESSH(es.ESSHConfig.preset("tiny"))
    byte_model.tokenizer = data.ByteTokenizer()
    byte_model.save_pretrained(tmp_path / "bytes")
    assert [p.name for p in (tmp_path / "bytes").iterdir() if "tokenizer" in p.name] == ["elastic_tokenizer.json"]
    assert isinstance(es.models.load_pretrained(tmp_path / "bytes").tokenizer, data.ByteTokenizer)
    assert (tmp_path / "none" / "notes.txt").read_text() == (tmp_path / "bytes" / "notes.txt").read_text() == "mine"


def test_a_hugging_face_tokenizer_folder_loads_by_path(bpe_run, tmp_path):
    """tokenizer.json + tokenizer_config.json (a downloaded GPT-2 / Llama folder): the config names the specials."""
    _, tok = bpe_run
    raw = tok._tok.__class__.from_str(tok._tok.to_str())
    raw.add_special_tokens(["<|begin|>", "<|end|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin|>", "eos_token": {"content": "<|end|>", "special": True}}))
    loaded = data.load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id) == (raw.token_to_id("<|begin|>"), raw.token_to_id("<|end|>"))
    assert loaded.vocab_size == tok.vocab_size + 2 and loaded.encode("x = 1") == tok.encode("x = 1")


def test_eval_and_generate_use_the_saved_tokenizer(bpe_run, capsys):
    root, _ = bpe_run
    final, tok_file = str(root / "run" / "final"), str(root / "tok" / "tokenizer.json")
    outs = []
    for extra in ([], ["--tokenizer", tok_file]):
        assert main(["eval", final, "--tiers", "T1,T10", "--seq-len", "32", "--batch-size", "2", "--n_batches", "1",
                     *extra]) == 0
        assert main(["generate", final, "--tier", "T2", "--prompt", "def ", "--max-new-tokens", "6",
                     "--temperature", "0", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "bytes per token measured" in outs[0]


def test_a_different_tokenizer_is_a_one_line_error(bpe_run, capsys):
    root, _ = bpe_run
    final = str(root / "run" / "final")
    for other in ("bytes", str(root / "other" / "tokenizer.json")):
        if other != "bytes":
            data.train_bpe([d for _, d in zip(range(6), iter_documents("stdlib"))], 290, other)
        assert main(["eval", final, "--tokenizer", other, "--n_batches", "1", "--seq-len", "16"]) == 2
        err = capsys.readouterr().err.strip()
        assert "is not the tokenizer saved with the model" in err and len(err.splitlines()) == 1
        from elastic_ssm.eval.lm_harness import ElasticLM

        with pytest.raises(ValueError, match="is not the tokenizer saved with the model"):
            ElasticLM(final, tier="T2", tokenizer=other)


def test_exports_carry_tokenizer_and_model_card(bpe_run, tmp_path):
    root, tok = bpe_run
    assert main(["export", str(root / "run" / "final"), "--tiers", "T3", "--out", str(tmp_path / "ex"),
                 "--check-len", "8"]) == 0
    d = tmp_path / "ex" / "T3"
    small = es.ESSH.from_pretrained(d)
    assert small.tokenizer.sha256 == tok.sha256
    card = (d / "README.md").read_text()
    assert f"{small.num_parameters():,}" in card and "T3" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "ESSH.from_pretrained" in card
    assert f"{es.elastic.tiers.state_bytes(small.config)['total']:,}" in card


def test_saved_files_are_0644_under_umask_022(tmp_path):
    old = os.umask(0o022)
    try:
        model = es.ESSH(es.ESSHConfig.preset("tiny"))
        model.tokenizer = data.load_tokenizer("bytes")
        model.save_pretrained(tmp_path / "m")
        files = list((tmp_path / "m").iterdir())
        assert {"model.safetensors", "config.json", "elastic_tokenizer.json", "tokenizer.json"} <= \
            {p.name for p in files}
        assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}
        os.umask(0o077)
        model.save_pretrained(tmp_path / "private")
        assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "private").iterdir()} == {0o600}
    finally:
        os.umask(old)


def test_saving_one_model_twice_writes_the_same_bytes(tmp_path):
    """Reproducible saves: the weights file (and so its recorded sha256) does not depend on the save."""
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    digests = set()
    for i in range(6):
        model.save_pretrained(tmp_path / str(i))
        digests.add(json.loads((tmp_path / str(i) / "config.json").read_text())["weights_sha256"])
    assert len(digests) == 1


def test_loading_a_saved_model_imports_no_scipy(tmp_path):
    """scipy (~0.3 s of import) serves only the spectral initialisation; a load and a forward never need it
    (issue 39: the load of a fresh process)."""
    import subprocess
    import sys

    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path)
    code = (f"import sys, torch, elastic_ssm as es; m = es.ESSH.from_pretrained({str(tmp_path)!r}, tier='T4'); "
            "m(torch.zeros(1, 8, dtype=torch.long)); print(sorted({n.split('.')[0] for n in sys.modules}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "scipy" not in p.stdout and "torch" in p.stdout, p.stdout


def test_byte_model_directory_tokenizes_like_the_byte_tokenizer(tmp_path):
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    model.tokenizer = data.load_tokenizer("bytes")
    model.save_pretrained(tmp_path)
    file_tok = data.BPETokenizer.from_file(tmp_path / "tokenizer.json")
    text = "naïve café ✓ \x00\t\n"
    assert file_tok.encode(text) == list(text.encode("utf-8"))
    assert file_tok.decode(file_tok.encode(text)) == text
    assert isinstance(es.ESSH.from_pretrained(tmp_path).tokenizer, data.ByteTokenizer)


def test_torch_export_of_the_forward():
    torch.manual_seed(0)
    model = es.ESSH(es.ESSHConfig.preset("tiny")).eval()
    small = es.export_tier(model, "T4").eval()
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    program = torch.export.export(small, (x,))
    torch.testing.assert_close(program.module()(x), small(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="token ids must lie"):          # eager validation stays
        small(torch.full((1, 4), model.config.vocab_size))


def test_resuming_a_run_from_before_tokenizers_set_eos_and_pad(tmp_path):
    """A run saved with eos / pad = -1 (as every run was before) resumes: the saved ids are kept."""
    (tmp_path / "run.yaml").write_text(BPE_RUN.replace("TOK", "bytes"))
    base = ["train", "--config", str(tmp_path / "run.yaml"), "--train.out_dir", str(tmp_path / "run"),
            "--train.checkpoint.every", "1"]
    assert main([*base, "--train.steps", "1", "--model.eos_token_id", "-1", "--model.pad_token_id", "-1"]) == 0
    assert main([*base, "--train.steps", "1", "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["config"]["eos_token_id"] == -1
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--train.out_dir", str(tmp_path / "new")]) == 0
    assert json.loads((tmp_path / "new" / "final" / "config.json").read_text())["config"]["eos_token_id"] == 258


def test_a_tier_is_not_saved_over_the_directory_it_was_read_from(tmp_path):
    """``ESSH.from_pretrained(d, tier=...).save_pretrained(d)`` had replaced ``d``'s whole model with the tier's
    slice; it refuses and leaves ``d`` as it was. Elsewhere it saves."""
    es.ESSH(es.ESSHConfig.preset("tiny")).save_pretrained(tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    small = es.ESSH.from_pretrained(tmp_path / "m", tier="T2")
    with pytest.raises(ValueError, match="holds the model this tier T2 was read from"):
        small.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    small.save_pretrained(tmp_path / "t2")
    whole, tier = (es.ESSH.from_pretrained(tmp_path / d).num_parameters() for d in ("m", "t2"))
    assert tier < whole


@pytest.mark.parametrize("cls,cfg,tier", [(es.ESSH, es.ESSHConfig, "T4"), (es.ESSSM, es.ESSSMConfig, 4)])
def test_from_pretrained_float64_converts_every_tensor(tmp_path, cls, cfg, tier):
    """``dtype=torch.float64`` left the mixer's keep-fp32 tensors in float32 beside float64 weights: an ESSH's forward
    then failed (linalg.vector_norm 'convertible without narrowing'). Upward, every tensor converts."""
    torch.manual_seed(0)
    model = cls(cfg.preset("tiny"))
    model.save_pretrained(tmp_path / "m")
    x = torch.randint(0, 256, (1, 12))
    wide = cls.from_pretrained(tmp_path / "m", tier=tier, dtype=torch.float64)
    assert {p.dtype for p in wide.state_dict().values() if p.is_floating_point()} == {torch.float64}
    assert torch.equal(wide(x), cls.from_pretrained(tmp_path / "m", tier=tier).double()(x))
    assert wide.generate(x, max_new_tokens=2).shape == (1, 14)
