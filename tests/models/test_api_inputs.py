"""Odd input on the Python API path of the models (caches, generate, save_pretrained): one-line errors that name the
problem, never a deep torch error or a silently wrong result, and a saved model is never lost."""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.config import ConfigError


@pytest.fixture(scope="module")
def essh():
    torch.manual_seed(0)
    return es.ESSH(es.ESSHConfig.preset("tiny")).eval()


@pytest.fixture(scope="module")
def esssm():
    torch.manual_seed(0)
    return es.ESSSM(es.ESSSMConfig.preset("tiny")).eval()


def test_a_cache_of_another_tier_batch_or_kind_is_named(essh, esssm):
    """Each was a shape mismatch deep in a layer (or an AttributeError) for ESSH; ES-SSM checked only some."""
    ids = torch.randint(0, 200, (2, 5))
    with pytest.raises(ValueError, match="batch=2 sequences, input_ids has 1"):
        essh(ids[:1], cache=essh.allocate_cache(2))
    with pytest.raises(ValueError, match="built for tier T4 .* runs at T2"):
        essh(ids, tier="T2", cache=essh.allocate_cache(2, "T4"))
    with pytest.raises(ValueError, match="built for tier T4 .* runs at T10"):
        essh(ids, cache=essh.allocate_cache(2, "T4"))
    essh(ids, tier=["T1", "T4"], cache=essh.allocate_cache(2, "T4"))      # rows nested in the cache's tier
    for model in (essh, esssm):
        with pytest.raises(TypeError, match="cache must be the .*Cache of model.allocate_cache"):
            model(ids, cache={})
        for cache in (None, {}):
            with pytest.raises(TypeError, match="cache must be"):
                model.step(ids[:, 0], cache)


@pytest.mark.parametrize("arch", ["essh", "esssm"])
@pytest.mark.parametrize("name", ["state_dtype", "kv_dtype"])
@pytest.mark.parametrize("dtype", [torch.int32, "float32", torch.bool, torch.float8_e4m3fn])
def test_cache_dtypes_must_be_floating_torch_dtypes(request, arch, name, dtype):
    """``kv_dtype=torch.int32`` truncated the window's keys and values to integers: every logit of a decode step
    was silently wrong; ``state_dtype="float32"`` was an AttributeError."""
    model = request.getfixturevalue(arch)
    ids = torch.randint(0, 200, (1, 4))
    with pytest.raises(TypeError, match=f"{name} must be None .* or a floating torch.dtype"):
        model.allocate_cache(1, **{name: dtype})
    with pytest.raises(TypeError, match=f"{name} must be"):
        model.generate(ids, 2, **{name: dtype})


def test_allocate_cache_names_a_device_this_machine_lacks(essh):
    """It was torch's ``AssertionError: Torch not compiled with CUDA enabled``; meta stays (shapes and bytes)."""
    if torch.cuda.is_available():
        pytest.skip("the machine has CUDA")
    with pytest.raises(ConfigError, match="allocate_cache.device=. 'cuda': CUDA is not available"):
        essh.allocate_cache(1, device="cuda")
    assert essh.allocate_cache(1, device="meta").positions.device.type == "meta"


@pytest.mark.parametrize("fail_at", ["pieces_record", "remote_code"])
def test_an_interrupted_save_pretrained_leaves_the_model_saved_there_before(tmp_path, monkeypatch, fail_at):
    """The weights were replaced first and config.json last, hashing the whole blob in between: Ctrl-C or an error
    there left new weights beside the old config.json, a directory that no longer loaded (the old model lost)."""
    from elastic_ssm.models import model_dir

    torch.manual_seed(0)
    old, new = es.ESSH(es.ESSHConfig.preset("tiny")), es.ESSH(es.ESSHConfig.preset("tiny"))
    old.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("mine")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_dir, fail_at, interrupted)     # models/base calls them through the module
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path / "m")
    monkeypatch.undo()
    again = es.ESSH.from_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), old.state_dict().values()))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        ["config.json", "model.safetensors", "configuration_essh.py", "modeling_essh.py", "notes.txt"])
    new.save_pretrained(tmp_path / "m")                       # and a save that ends replaces it
    again = es.ESSH.from_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), new.state_dict().values()))
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"


def test_save_pretrained_names_a_meta_model_and_a_file_target(essh, tmp_path):
    """A meta model was torch's NotImplementedError 'Cannot copy out of meta tensor' after creating the directory;
    a file where the directory belongs was a FileExistsError of mkdir."""
    with torch.device("meta"):
        shape = es.ESSH(es.ESSHConfig.preset("tiny"))
    with pytest.raises(ValueError, match="meta device .*load or initialise the weights"):
        shape.save_pretrained(tmp_path / "meta")
    assert not (tmp_path / "meta").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="that is a file; a model is saved into a directory"):
        essh.save_pretrained(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_generate_with_a_huge_max_new_tokens_stops_at_eos(essh):
    """max_new_tokens is a bound, as in transformers: 10**12 with an eos tried to allocate [B, 10**12] up front
    (torch's 'DefaultCPUAllocator: can't allocate memory')."""
    ids = torch.randint(0, 200, (1, 6))
    first = int(essh.generate(ids, 1)[0, -1])
    out = essh.generate(ids, 10**12, eos_token_id=first, sync_every=1)
    assert out.shape == (1, 7) and int(out[0, -1]) == first
    long = essh.generate(ids, 1030, fast=False)             # past the first buffer (1024): it grows, nothing changes
    assert long.shape == (1, 1036) and torch.equal(long[:, :12], essh.generate(ids, 6, fast=False))


@pytest.mark.parametrize("kw,match", [
    (dict(generator=0), "generator must be None or a torch.Generator"),          # a seed is not a generator
    (dict(generator="0", do_sample=False), "generator must be"),                 # greedy ignored it silently
    (dict(eos_token_id=True), "eos_token_id must be a token id"),                # was taken as token 1
    (dict(pad_token_id=False, eos_token_id=3), "pad_token_id must be a token id"),
    (dict(do_sample="no"), "do_sample must be True, False or None"),             # a truthy string sampled
])
def test_generate_names_odd_sampling_arguments(essh, kw, match):
    with pytest.raises(TypeError if "generator" in kw or "do_sample" in kw else ValueError, match=match):
        essh.generate(torch.randint(0, 200, (1, 4)), 2, **kw)
