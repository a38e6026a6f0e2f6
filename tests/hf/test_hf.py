"""Hugging Face transformers adapter (``elastic_ssm.hf``): our model directories load through the Auto
classes, and HF ``generate`` / ``pipeline`` produce the tokens of our own ``ESSH.generate``."""

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

import elastic_ssm as es
import elastic_ssm.hf  # registers model_type "essh" with the Auto classes

PROMPT = torch.tensor([list(b"def foo(x):")])


def test_auto_classes_load_our_directory(saved):
    model, path = saved
    cfg = AutoConfig.from_pretrained(path)
    assert isinstance(cfg, elastic_ssm.hf.ESSHHFConfig) and cfg.tiers[3]["name"] == "T4"
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(hf, elastic_ssm.hf.ESSHForCausalLM)
    assert sum(p.numel() for p in hf.parameters()) == model.num_parameters()
    t4 = AutoModelForCausalLM.from_pretrained(path, tier="T4")          # only T4's prefixes are read
    assert t4.config.tier == "T4" and t4.model.config.n_channels == model.resolve_tier("T4").K
    assert sum(p.numel() for p in t4.parameters()) == model.num_parameters("T4")


@pytest.mark.parametrize("tier", [None, "T4"])
def test_greedy_generate_equals_ours(saved, tier):
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path, tier=tier)
    ours = model.generate(PROMPT, max_new_tokens=24, tier=tier, temperature=0.0)
    theirs = hf.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert torch.equal(theirs, ours)


def test_sampling_equals_ours_under_the_same_seed(saved):
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    for ours_kw, hf_kw in (({"temperature": 0.7, "top_k": 20}, {"temperature": 0.7, "top_k": 20}),
                           ({"temperature": 0.9, "top_p": 0.8}, {"temperature": 0.9, "top_p": 0.8, "top_k": 0})):
        torch.manual_seed(3)
        ours = model.generate(PROMPT, max_new_tokens=20, **ours_kw)
        torch.manual_seed(3)
        theirs = hf.generate(PROMPT, max_new_tokens=20, do_sample=True, **hf_kw)
        assert torch.equal(theirs, ours)
        assert len(set(ours[0, PROMPT.shape[1]:].tolist())) > 3          # really sampled


def test_left_padded_batch_with_eos_equals_ours(saved, tmp_path):
    model, path = saved
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.padding_side == "left"
    enc = tok(["import os", "def f(a, b):\n    return", "x"], return_tensors="pt", padding=True)
    assert enc["attention_mask"][2, -1] == 1 and enc["attention_mask"][2].sum() == 1     # "x", left-padded
    free = model.generate(enc["input_ids"], max_new_tokens=10, temperature=0.0, attention_mask=enc["attention_mask"])
    eos = int(free[1, -7])                         # a token row 1 emits mid-way: make it the end of sequence
    stopping = es.ESSH.from_pretrained(path)
    stopping.config = stopping.config.replace(eos_token_id=eos)
    stopping.save_pretrained(tmp_path / "eos")
    ours = stopping.generate(enc["input_ids"], max_new_tokens=10, temperature=0.0, attention_mask=enc["attention_mask"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "eos")
    theirs = hf.generate(**enc, max_new_tokens=10, do_sample=False)
    assert (ours == eos).any() and torch.equal(theirs, ours)


def test_forward_loss_and_cache(saved):
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = hf(x, labels=x)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast) and out.cache is None
    logits = model(x)
    torch.testing.assert_close(out.logits, logits)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    loss, plain = hf(x, labels=x, return_dict=False)            # was the ModelOutput: a tuple, as transformers gives
    assert isinstance(hf(x, return_dict=False), tuple) and torch.equal(plain, out.logits)
    assert torch.equal(loss, out.loss)
    cache = hf(x[:, :-1], use_cache=True).cache
    assert isinstance(cache, elastic_ssm.hf.ESSHHFCache) and cache.get_seq_length() == 15
    assert cache.nbytes()["total"] == es.elastic.tiers.state_bytes(model.config, batch=2, kv_dtype_bytes=4)["total"]
    step = hf(x[:, -1:], cache=cache).logits
    torch.testing.assert_close(step[:, 0], logits[:, -1], rtol=1e-4, atol=1e-4)


def test_pipeline_text_generation(saved):
    model, path = saved
    gen = pipeline("text-generation", model=str(path))
    text = gen("def main():", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ids = model.generate(torch.tensor([list(b"def main():")]), max_new_tokens=12, temperature=0.0)
    assert text == model.tokenizer.decode(ids[0].tolist())


def test_beam_search_scores_equal_the_forward(saved):
    """Beam search reorders the cache rows every step (``ESSHHFCache`` -> ``ESSHCache.apply_``): each returned
    beam's score must equal its log-probability under a full forward pass."""
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    out = hf.generate(PROMPT, max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False,
                      length_penalty=0.0, early_stopping=True, output_scores=True, return_dict_in_generate=True)
    T = PROMPT.shape[1]
    with torch.no_grad():
        logp = model(out.sequences).float().log_softmax(-1)[:, T - 1:-1]
    want = logp.gather(-1, out.sequences[:, T:, None]).squeeze(-1).sum(-1)
    assert len(set(map(tuple, out.sequences.tolist()))) == 3
    torch.testing.assert_close(out.sequences_scores.float(), want, rtol=1e-4, atol=1e-4)


def test_generation_defaults_are_ours_not_transformers(saved):
    """transformers 5 defaults to top_k=50 and the text-generation pipeline to sampling at temperature 0.7;
    the wrapper's generation_config restores ESSH.generate's defaults (greedy; no top-k unless asked)."""
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert hf.generation_config.do_sample is False
    ours = model.generate(PROMPT, max_new_tokens=16)                        # no sampling arguments: greedy
    assert torch.equal(hf.generate(PROMPT, max_new_tokens=16), ours)
    for kw in ({"top_p": 0.9}, {}, {"temperature": 1.3}):                  # no top_k given: no top-k cut
        torch.manual_seed(5)
        ours = model.generate(PROMPT, max_new_tokens=24, do_sample=True, **kw)
        torch.manual_seed(5)
        theirs = hf.generate(PROMPT, max_new_tokens=24, do_sample=True, **kw)
        assert torch.equal(theirs, ours), kw
    gen = pipeline("text-generation", model=str(path))
    texts = [gen("def main():", max_new_tokens=16)[0]["generated_text"] for _ in range(2)]
    ids = model.generate(torch.tensor([list(b"def main():")]), max_new_tokens=16)
    assert texts == [model.tokenizer.decode(ids[0].tolist())] * 2              # no do_sample: greedy, ours
    torch.manual_seed(7)
    sampled = gen("def main():", max_new_tokens=16, do_sample=True)[0]["generated_text"]
    torch.manual_seed(7)
    ids = model.generate(torch.tensor([list(b"def main():")]), max_new_tokens=16, do_sample=True)
    assert sampled == model.tokenizer.decode(ids[0].tolist())                  # temperature 1, not 0.7


@pytest.mark.parametrize("tier", ["", "  "])
def test_an_empty_tier_is_an_error_not_the_full_model(saved, tier):
    _, path = saved
    with pytest.raises(ValueError, match=r"is empty: give a tier name such as 'T4'"):
        AutoModelForCausalLM.from_pretrained(path, tier=tier)
    with pytest.raises(ValueError, match="is empty"):                       # the tier given through the config
        AutoModelForCausalLM.from_pretrained(path, config=AutoConfig.from_pretrained(path, tier=tier))
    with pytest.raises(ValueError, match="is empty"):
        elastic_ssm.hf.ESSHHFConfig(tier=tier)
    assert AutoModelForCausalLM.from_pretrained(path, tier="full").config.tier is None


def test_apply_chat_template_renders_a_serve_builtin_for_our_tokenizer(saved):
    """A base model has no template of its own; transformers' apply_chat_template takes one of serve's built-in
    templates (the same text `serve --chat_template chatml` renders) and the ids are our byte tokens."""
    from elastic_ssm.serve.tokens import BUILTIN

    _, path = saved
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, chat_template=BUILTIN["chatml"], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(chat, chat_template=BUILTIN["chatml"], add_generation_prompt=True)["input_ids"]
    assert bytes(ids) == text.encode()


def test_special_token_strings_in_text_are_ids_unless_split_as_the_docs_say(saved):
    """docs/huggingface.md: AutoTokenizer maps a literal "<eos>" in text to its id (as transformers does for any
    tokenizer); ``split_special_tokens=True`` gives ByteTokenizer's bytes, as training read them."""
    from elastic_ssm.data.tokenizers import ByteTokenizer

    _, path = saved
    tok, ours = AutoTokenizer.from_pretrained(path), ByteTokenizer()
    text = "a<eos>b"
    assert tok(text)["input_ids"] == [97, ours.eos_id, 98]
    assert tok(text, split_special_tokens=True)["input_ids"] == ours.encode(text) == list(text.encode())


def test_a_template_in_the_directory_is_used_without_the_argument(saved, tmp_path):
    import json
    import shutil

    from elastic_ssm.serve.tokens import BUILTIN

    _, path = saved
    shutil.copytree(path, tmp_path / "m")
    cfg = tmp_path / "m" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": BUILTIN["plain"]}))
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "User: hi\nAssistant:"


def test_a_tier_is_not_saved_over_the_directory_it_was_read_from(saved, tmp_path):
    """``from_pretrained(dir, tier="T2").save_pretrained(dir)`` replaced the directory's whole model with T2's slice;
    an export of it saved over its source directory would too. Elsewhere, or the whole model over itself, it saves."""
    import shutil

    _, path = saved
    shutil.copytree(path, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "m", tier="T2")
    with pytest.raises(ValueError, match="holds the model this tier T2 was read from"):
        small.save_pretrained(tmp_path / "m")
    small.save_pretrained(tmp_path / "t2")
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "t2")
    assert export.num_parameters() == small.num_parameters()
    with pytest.raises(ValueError, match="holds the model this tier T2 was read from"):
        export.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    AutoModelForCausalLM.from_pretrained(tmp_path / "m").save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before


def test_a_dtype_name_torch_lacks_is_named(saved):
    """It was ``AttributeError: module 'torch' has no attribute 'float23'`` (through ``AutoModelForCausalLM``
    transformers' own config raises that first, as for any model)."""
    _, path = saved
    with pytest.raises(TypeError, match="takes a floating torch.dtype .* got 'float23'"):
        elastic_ssm.hf.ESSHForCausalLM.from_pretrained(path, dtype="float23")
    assert elastic_ssm.hf.ESSHForCausalLM.from_pretrained(path, dtype="bfloat16").dtype == torch.bfloat16


def test_resize_token_embeddings_is_refused_and_changes_nothing(saved):
    """It was transformers' ``set_input_embeddings not auto-handled`` after the embedding had grown to the new size."""
    hf = AutoModelForCausalLM.from_pretrained(saved[1])
    with pytest.raises(NotImplementedError, match=r"cannot resize its token embeddings \(vocab_size 260 is fixed"):
        hf.resize_token_embeddings(300)
    assert hf.get_input_embeddings().num_embeddings == hf.config.vocab_size == 260


def test_output_hidden_states_are_the_embedding_each_block_and_the_final_norm(saved):
    """They were None: now n_layers + 1 tensors [B, T, D], the embedding output first, the last after the final norm
    (what the LM head reads), the same from a cached step as from the whole sequence, and through ``generate``."""
    model, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    x = PROMPT
    hs = hf(x, output_hidden_states=True).hidden_states
    assert len(hs) == model.config.n_layers + 1 and all(h.shape == (1, x.shape[1], 64) for h in hs)
    torch.testing.assert_close(hs[0], model.embed(x))
    torch.testing.assert_close(hs[-1], model.hidden_states(x))
    assert not torch.equal(hs[1], hs[2]) and hf(x).hidden_states is None
    cache = hf(x[:, :-1], use_cache=True).cache
    step = hf(x[:, -1:], cache=cache, output_hidden_states=True).hidden_states
    for a, b in zip(step, hs):
        torch.testing.assert_close(a, b[:, -1:], rtol=1e-4, atol=1e-4)
    out = hf.generate(x, max_new_tokens=3, output_hidden_states=True, return_dict_in_generate=True)
    assert len(out.hidden_states) == 3 and out.hidden_states[1][-1].shape == (1, 1, 64)


def test_a_list_of_eos_ids_stops_ours_and_theirs_alike(saved):
    """``eos_token_id=[a, b]`` (as generation_config.json files give it) was refused by our generate: now a row stops
    at either id and repeats the first, in ours and through the wrapper; a wrong type is one line."""
    model, path = saved
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(["import os", "def f(a, b):\n    return", "x"], return_tensors="pt", padding=True)
    free = model.generate(enc["input_ids"], max_new_tokens=10, temperature=0.0, attention_mask=enc["attention_mask"])
    stops = [int(free[1, -7]), int(free[0, -5])]
    ours = model.generate(enc["input_ids"], max_new_tokens=10, temperature=0.0, attention_mask=enc["attention_mask"],
                          eos_token_id=stops)
    theirs = AutoModelForCausalLM.from_pretrained(path).generate(**enc, max_new_tokens=10, eos_token_id=stops)
    assert torch.equal(theirs, ours) and not torch.equal(ours, free)
    new = ours[:, enc["input_ids"].shape[1]:]
    assert (new == stops[1]).any()                                   # a row stopped at the second id
    for row in new.tolist():                                         # and every stopped row repeats the first
        hit = [i for i, t in enumerate(row) if t in stops]
        assert not hit or set(row[hit[0] + 1:]) <= {stops[0]}
    assert torch.equal(ours, model.generate(enc["input_ids"], max_new_tokens=10, temperature=0.0, eos=tuple(stops),
                                            attention_mask=enc["attention_mask"]))
    for bad in ([], [1, "2"], "2", [1, 999]):
        with pytest.raises(ValueError, match=r"eos_token_id must be a token id in \[0, vocab_size=260\) or a non"):
            model.generate(PROMPT, max_new_tokens=2, eos_token_id=bad)


def test_generation_config_is_saved_and_loaded_as_transformers_does(saved, tmp_path):
    """``save_pretrained`` wrote no ``generation_config.json`` and ``from_pretrained`` read none (nor took
    ``generation_config=``): a saved ``max_new_tokens`` or a directory's own eos ids were silently dropped."""
    from transformers import GenerationConfig

    _, path = saved
    hf = AutoModelForCausalLM.from_pretrained(path)
    hf.generation_config.max_new_tokens = 7
    hf.save_pretrained(tmp_path / "m")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert back.generation_config.max_new_tokens == 7 and back.generate(PROMPT).shape[1] == PROMPT.shape[1] + 7
    assert back.generation_config.do_sample is False                      # our defaults travel with it
    x = torch.tensor([list(b"def f(a, b):\n    return")])
    free = hf.generate(x, max_new_tokens=7)[0, x.shape[1]:].tolist()
    assert free[1] != free[0]
    GenerationConfig(max_new_tokens=7, eos_token_id=[free[0]]).save_pretrained(tmp_path / "m")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").generate(x)[0, x.shape[1]:].tolist() == free[:1]
    given = AutoModelForCausalLM.from_pretrained(path, generation_config=GenerationConfig(max_new_tokens=3))
    assert given.generate(PROMPT).shape[1] == PROMPT.shape[1] + 3


@pytest.mark.parametrize("kw", [{"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
                                {"load_in_4bit": True}])
def test_a_loading_option_the_wrapper_does_not_apply_is_refused(saved, kw):
    """``quantization_config=`` / ``load_in_4bit=True`` (lm-eval's ``--model_args load_in_4bit=True`` too)
    were ignored: a float32 model came back as if quantized. Now one line naming the option and what to do."""
    with pytest.raises(ValueError, match=rf"does not apply {next(iter(kw))}=.*torchao"):
        AutoModelForCausalLM.from_pretrained(saved[1], **kw)


def test_subfolder_and_output_loading_info_are_honoured(saved, tmp_path):
    """``subfolder="model"`` (a checkpoint's model/) loaded the folder above, and ``output_loading_info=True``
    returned the model alone where transformers returns ``(model, info)``."""
    import shutil

    shutil.copytree(saved[1], tmp_path / "ckpt" / "model")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", subfolder="model", tier="T4")
    assert hf.num_parameters() == saved[0].num_parameters("T4")
    hf, info = AutoModelForCausalLM.from_pretrained(saved[1], output_loading_info=True)
    assert isinstance(hf, elastic_ssm.hf.ESSHForCausalLM) and info["missing_keys"] == info["unexpected_keys"] == []
