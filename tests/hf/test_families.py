"""ES-SSM, Transformer++ and MatFormer directories in transformers (issue 41): each saved language model carries its
``auto_map`` and remote-code modules, so a fresh process that never imported ``elastic_ssm`` loads it with
``trust_remote_code=True`` alone, and greedy ``generate`` there equals our own greedy output at the full model and
at a sliced tier (ES-SSM: the first K spectral channels; MatFormer: the first n_ff FFN units). ``import
elastic_ssm.hf`` loads the same directories without remote code."""

import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm import data
from elastic_ssm.config import MatFormerConfig, TransformerConfig
from elastic_ssm.models.baselines import MatFormer, TransformerPP
from elastic_ssm.models.model_dir import FAMILIES, auto_map, remote_code

pytest.importorskip("transformers", reason="the hf extra is installed by the dev extra; CI runs these")

PROMPT = torch.tensor([list(b"def foo(x):")])
NEW = 12


def _saved(model, root):
    """``model`` with weights spread wide enough that greedy decoding does not repeat one token, saved under
    ``root`` with the byte tokenizer."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.5)
    model.tokenizer = data.load_tokenizer("bytes")
    path = root / model.arch
    model.eval().save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    return {"es_ssm": _saved(es.ESSSM(es.ESSSMConfig.preset("tiny", vocab_size=260)), root),
            "transformer": _saved(TransformerPP(TransformerConfig.preset("tiny", vocab_size=260)), root),
            "matformer": _saved(MatFormer(MatFormerConfig.preset("tiny", vocab_size=260)), root)}


def ours(model, tier):
    """Our greedy continuation of PROMPT: ``ESSSM.generate``, or for the baselines (which have no ``generate``)
    the argmax of a full forward per token, recomputed from scratch (no cache)."""
    if isinstance(model, es.ESSSM):
        return model.generate(PROMPT, max_new_tokens=NEW, tier=tier)[0].tolist()
    ids = PROMPT
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids, tier=tier)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


#: (arch, tier): every family at the full model, the ones with tiers at a sliced one (Transformer++ has one tier)
CASES = [("es_ssm", ""), ("es_ssm", "K4"), ("transformer", ""), ("matformer", ""), ("matformer", "T4")]


def test_each_directory_names_its_remote_code(dirs):
    for arch, (_, path) in dirs.items():
        meta = json.loads((path / "config.json").read_text())
        assert meta["model_type"] == FAMILIES[arch].model_type and meta["auto_map"] == auto_map(arch)
        assert meta["architectures"] == [FAMILIES[arch].model_class]
        for name, text in remote_code(arch).items():
            assert (path / name).read_text() == text


@pytest.mark.parametrize("arch,tier", CASES)
def test_trust_remote_code_generates_our_tokens(dirs, arch, tier, remote_generate):
    model, path = dirs[arch]
    got = remote_generate(path, tier)
    assert (got["config"], got["model"]) == (FAMILIES[arch].config_class, FAMILIES[arch].model_class)
    assert got["params"] == model.num_parameters(tier or None)
    want = ours(model, tier or None)
    assert got["tokens"] == want
    assert len(set(want[PROMPT.shape[1]:])) >= 2           # a real continuation, not one repeated token


@pytest.mark.parametrize("arch,tier", CASES)
def test_our_import_loads_them_without_remote_code(dirs, arch, tier):
    from transformers import AutoConfig, AutoModelForCausalLM

    import elastic_ssm.hf  # noqa: F401  (registers every family)

    model, path = dirs[arch]
    kw = {"tier": tier} if tier else {}
    assert type(AutoConfig.from_pretrained(path, **kw)).__name__ == FAMILIES[arch].config_class
    hf = AutoModelForCausalLM.from_pretrained(path, **kw)
    assert type(hf).__name__ == FAMILIES[arch].model_class and hf.config.tier == (tier or None)
    assert hf.generate(PROMPT, max_new_tokens=NEW, do_sample=False)[0].tolist() == ours(model, tier or None)


@pytest.mark.parametrize("arch,tier", [("es_ssm", "K4"), ("matformer", "T4")])
def test_an_export_loads_the_same_way(dirs, arch, tier, tmp_path, remote_generate):
    model, _ = dirs[arch]
    small = es.export_tier(model, tier)
    small.save_pretrained(tmp_path / "x")
    got = remote_generate(tmp_path / "x")
    assert got["params"] == model.num_parameters(tier) and got["tokens"] == ours(model, tier)


def test_a_left_padded_batch_and_beams_run(dirs):
    """Left padding equals each row alone; beam search reorders the cache (two beams, no error, right length)."""
    from transformers import AutoModelForCausalLM

    import elastic_ssm.hf  # noqa: F401

    for arch in ("es_ssm", "matformer"):
        hf = AutoModelForCausalLM.from_pretrained(dirs[arch][1])
        rows = [list(b"abc"), list(b"hello")]
        ids = torch.tensor([[0, 0] + rows[0], rows[1]])
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        batch = hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        alone = hf.generate(torch.tensor([rows[0]]), max_new_tokens=4, do_sample=False)
        assert batch[0, -4:].tolist() == alone[0, -4:].tolist(), arch
        beams = hf.generate(PROMPT, max_new_tokens=6, num_beams=2, do_sample=False)
        assert beams.shape == (1, PROMPT.shape[1] + 6)


@pytest.mark.parametrize("arch", ["es_ssm", "transformer", "matformer"])
def test_output_hidden_states(dirs, arch):
    """n_layers + 1 tensors [B, T, D]: the embedding output, each block's, the last after the final norm (the LM
    head's input); a cached step gives the last position's."""
    from transformers import AutoModelForCausalLM

    import elastic_ssm.hf  # noqa: F401

    model, path = dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(path)
    out = hf(PROMPT, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == model.config.n_layers + 1 and hs[0].shape == (1, PROMPT.shape[1], model.config.d_model)
    torch.testing.assert_close(hs[0], model.embed(PROMPT))
    torch.testing.assert_close(model.logits_from_hidden(hs[-1]), out.logits)
    cache = hf.allocate_cache(1, PROMPT.shape[1] - 1, max_length=PROMPT.shape[1])   # a baseline's KV: T positions
    hf(PROMPT[:, :-1], cache=cache)
    step = hf(PROMPT[:, -1:], cache=cache, output_hidden_states=True).hidden_states
    for a, b in zip(step, hs):
        torch.testing.assert_close(a, b[:, -1:], rtol=1e-4, atol=1e-4)


def test_a_classifier_has_no_transformers_keys(tmp_path):
    clf = es.ESSSM(es.ESSSMConfig.preset("tiny", task="classify", num_classes=3))
    clf.save_pretrained(tmp_path / "clf")
    meta = json.loads((tmp_path / "clf" / "config.json").read_text())
    assert "auto_map" not in meta and "model_type" not in meta
    assert not list((tmp_path / "clf").glob("modeling_*.py"))
