"""ESSH model: exact counts, tier evaluation, export, save/load, cached decoding, padded generation."""

import json

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.model_dir import CheckpointError


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = es.ESSHConfig.preset("tiny")
    model = es.ESSH(cfg).eval()
    # Move away from the near-identity initialisation so every path matters in the comparisons.
    return randomize_selective(model, ffn_out_std=0.1)


@pytest.mark.parametrize("name", ["370m", "1.5b"])
def test_meta_instantiation_matches_config_counts(name):
    cfg = es.ESSHConfig.preset(name)
    with torch.device("meta"):
        model = es.ESSH(cfg)
        small = es.ESSH(es.ESSH.tier_config(cfg, es.elastic.tiers.resolve_tier(cfg, "T4")))
    assert sum(p.numel() for p in model.parameters()) == model.num_parameters()
    assert sum(p.numel() for p in small.parameters()) == model.num_parameters("T4")
    expected = {"370m": (370_866_144, 185_254_998), "1.5b": (1_531_089_696, 827_570_754)}[name]
    assert (model.num_parameters(), model.num_parameters("T4")) == expected


def test_every_tier_export_is_bitwise_equal(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (2, 40))
    for t in tiny.tier_table():
        res = es.check_export(tiny, t.name, input_ids=x)
        assert res.bitwise_equal, str(res)
        assert res.params_actual == res.params_expected == t.params


def test_tiers_differ_and_discarded_rows_get_no_gradient(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (2, 20))
    full, t1 = tiny(x), tiny(x, tier="T1")
    assert not torch.allclose(full, t1)
    tiny.zero_grad()
    tiny(x, tier="T1").square().mean().backward()
    t = tiny.resolve_tier("T1")
    mixer, c = tiny.blocks[0].mixer, tiny.config
    rows, cols = t.K * (c.value_width + 3 * c.n_modes), t.K * c.value_width   # in_proj rows, out_proj columns
    g_in, g_out = mixer.in_proj.weight.grad, mixer.out_proj.weight.grad
    assert g_in[rows:].abs().max() == 0 and g_in[:rows].abs().max() > 0
    assert g_out[:, cols:].abs().max() == 0 and g_out[:, :cols].abs().max() > 0
    ffn = tiny.blocks[0].ffn
    g_in, g_out = ffn.w_in.weight.grad, ffn.w_out.weight.grad                   # [2F, D] rows, [D, F] columns
    assert g_in[2 * t.n_ff:].abs().max() == 0 and g_in[: 2 * t.n_ff].abs().max() > 0
    assert g_out[:, t.n_ff:].abs().max() == 0 and g_out[:, : t.n_ff].abs().max() > 0
    tiny.zero_grad()


def test_mixer_truncation_identity_eq19(tiny):
    """y_Kbar - y_K = Kbar^-1/2 sum_{k>K} W_k z_k + (Kbar^-1/2 - K^-1/2) S_K   (ESSH Eq. 19)."""
    mixer = tiny.blocks[0].mixer.double()
    try:
        u = torch.randn(2, 30, mixer.D, dtype=torch.float64)
        Kb, K = mixer.K, 3
        from elastic_ssm.ops import naive_spectral_scan

        v, w, r, c = mixer._controls(u, Kb, None)
        z, _ = naive_spectral_scan(v, w, r, c, *mixer._modal(Kb))
        Wout = mixer.out_proj.weight.t().unflatten(0, (Kb, mixer.P))    # [K, P, D]
        contrib = torch.einsum("btkp,kpd->btkd", z, Wout)
        S_K = contrib[:, :, :K].sum(2)
        lhs = mixer(u, Kb) - mixer(u, K)
        rhs = contrib[:, :, K:].sum(2) / Kb**0.5 + (Kb**-0.5 - K**-0.5) * S_K
        torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-12)
    finally:
        tiny.blocks[0].mixer.float()


def test_save_load_round_trip_and_tier_loading(tiny, tmp_path):
    x = torch.randint(0, tiny.config.vocab_size, (2, 24))
    tiny.save_pretrained(tmp_path / "full")
    meta = json.loads((tmp_path / "full" / "config.json").read_text())
    assert [t["name"] for t in meta["tiers"]] == [f"T{i}" for i in range(1, 11)]
    loaded = es.ESSH.from_pretrained(tmp_path / "full")
    assert torch.equal(loaded(x), tiny(x))
    t4 = es.ESSH.from_pretrained(tmp_path / "full", tier="T4")
    assert torch.equal(t4(x), tiny(x, tier="T4"))
    assert sum(p.numel() for p in t4.parameters()) == tiny.num_parameters("T4")
    es.export_tier(tiny, "T4").save_pretrained(tmp_path / "t4")
    assert torch.equal(es.ESSH.from_pretrained(tmp_path / "t4")(x), t4(x))


def test_corrupted_and_mismatched_checkpoints(tiny, tmp_path):
    d = tiny.save_pretrained(tmp_path / "m")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupted"):
        es.ESSH.from_pretrained(d)
    tiny.save_pretrained(tmp_path / "m2")
    cfg = json.loads((tmp_path / "m2" / "config.json").read_text())
    cfg["config"]["d_ff"] = 128
    (tmp_path / "m2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        es.ESSH.from_pretrained(tmp_path / "m2")
    with pytest.raises(CheckpointError, match="does not exist"):
        es.ESSH.from_pretrained(tmp_path / "nothing")


@pytest.mark.parametrize("tier", ["T1", "T6", "T10"])
def test_decode_equals_full_forward_float64(tiny, tier):
    model = tiny.double()
    try:
        T = 2 * model.config.window + 9                      # past the window length
        x = torch.randint(0, model.config.vocab_size, (2, T))
        ref = model(x, tier=tier)
        P = 5
        cache = model.allocate_cache(2, tier, state_dtype=torch.float64, kv_dtype=torch.float64)
        out = [model(x[:, :P], tier=tier, cache=cache)]
        for t in range(P, T):
            out.append(model.step(x[:, t], cache)[:, None])
        torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-10)
    finally:
        tiny.float()


def test_cache_bytes_follow_the_config(tiny):
    for name in ("T1", "T10"):
        cache = tiny.allocate_cache(3, name, state_dtype=torch.float32, kv_dtype=torch.bfloat16)
        assert cache.nbytes() == es.elastic.tiers.state_bytes(tiny.config, name, batch=3)


def test_left_padded_batch_equals_unpadded(tiny):
    model = tiny.double()
    try:
        V = model.config.vocab_size
        seqs = [torch.randint(0, V, (n,)) for n in (7, 30, 19)]
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
        batch = model.generate(ids, 12, tier="T5", attention_mask=mask, temperature=0)
        logits = model(ids, tier="T5", attention_mask=mask)
        for i, s in enumerate(seqs):
            single = model.generate(s[None], 12, tier="T5", temperature=0)
            assert torch.equal(batch[i, T - len(s):], single[0])
            torch.testing.assert_close(logits[i, T - len(s):], model(s[None], tier="T5")[0], rtol=0, atol=1e-10)
    finally:
        tiny.float()


def test_generate_streams_and_samples(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (2, 5))
    seen = []
    g = torch.Generator().manual_seed(1)
    out = tiny.generate(x, 6, tier="T2", temperature=0.8, top_k=20, top_p=0.9, streamer=seen.append, generator=g)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], x)
    assert torch.equal(torch.stack(seen, 1), out[:, 5:])
    greedy = tiny.generate(x, 4, temperature=0)
    cur = x
    for _ in range(4):
        cur = torch.cat([cur, tiny(cur)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, cur)


def test_generate_feeds_a_transformers_streamer_as_transformers_generate_does(tiny):
    """A transformers streamer (put / end, e.g. TextStreamer) was called as a function ("object is not callable");
    it now gets the prompt, each step's tokens on the CPU and end(), so a TextIteratorStreamer yields the text."""
    from transformers import TextIteratorStreamer

    from elastic_ssm.data.tokenizers import ByteTokenizer

    class Recorder:
        def __init__(self):
            self.put_calls, self.ended = [], 0

        def put(self, value):
            self.put_calls.append(value.clone())

        def end(self):
            self.ended += 1

    x = torch.randint(3, 200, (1, 5))
    rec = Recorder()
    out = tiny.generate(x, 4, streamer=rec)
    assert torch.equal(rec.put_calls[0], x) and rec.ended == 1
    assert torch.equal(torch.stack([t for t in rec.put_calls[1:]], 1), out[:, 5:])
    assert all(t.device.type == "cpu" for t in rec.put_calls)

    class Tok:                              # the two methods TextIteratorStreamer uses, over our byte tokenizer
        def decode(self, ids, **kw):
            return ByteTokenizer().decode(list(ids))

    it = TextIteratorStreamer(Tok(), skip_prompt=True)
    out = tiny.generate(x, 6, streamer=it)
    assert "".join(it) == ByteTokenizer().decode(out[0, 5:].tolist())
    with pytest.raises(TypeError, match="streamer must be a function of each step's tokens"):
        tiny.generate(x, 2, streamer=object())


def test_generate_under_inference_mode_then_outside(tiny):
    """The pooled decoder built by a generate under torch.inference_mode serves a later generate outside it (its
    buffers are ordinary tensors, written in place by both), and the other way round."""
    from elastic_ssm.models.fast_decode import decoder_pool

    decoder_pool(tiny).clear()
    x = torch.randint(0, tiny.config.vocab_size, (2, 7))
    with torch.inference_mode():
        first = tiny.generate(x, 5, tier="T3", temperature=0)
    outside = tiny.generate(x, 5, tier="T3", temperature=0)
    with torch.inference_mode():
        inside = tiny.generate(x, 5, tier="T3", temperature=0)
    assert torch.equal(first, outside) and torch.equal(first, inside)
    assert not outside.requires_grad and torch.is_grad_enabled()


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="vocab_size"):
        tiny(torch.tensor([[0, 999]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        tiny(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        tiny(torch.zeros(1, 3, dtype=torch.long), tier="T11")
    with pytest.raises(ValueError, match="LEFT padding"):
        tiny.generate(torch.zeros(1, 3, dtype=torch.long), 1, attention_mask=torch.tensor([[1, 1, 0]]))


def test_forward_with_a_used_cache_is_refused(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (1, 6))
    cache = tiny.allocate_cache(1)
    state_before = cache.states[0]
    tiny(x, cache=cache)
    assert cache.states[0] is state_before and cache.states[0].abs().sum() > 0   # updated in place
    with pytest.raises(ValueError, match="continue a cached sequence with step"):
        tiny(x, cache=cache)


def test_swa_causal_fast_path_equals_the_band_mask():
    from elastic_ssm.layers.attention import SlidingWindowAttention, window_mask

    torch.manual_seed(0)
    attn = SlidingWindowAttention(32, 8, window=16).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    pos = torch.arange(16).expand(2, 16)
    fast = attn(x, pos)                                       # T <= window, no padding: is_causal path
    q, k, v = attn._qkv(x, pos)
    idx = torch.arange(16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(idx, idx, 16))
    ref = torch.nn.functional.linear(ref.transpose(1, 2).reshape(2, 16, 32), attn.out.weight)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-12)


def test_default_cache_on_cpu_keeps_the_model_precision(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (1, 2 * tiny.config.window))
    cache = tiny.allocate_cache(1, "T3")
    assert cache.rings[1].keys.dtype == torch.float32 and cache.states[0].dtype == torch.float32
    out = [tiny(x[:, :3], tier="T3", cache=cache)]
    out += [tiny.step(x[:, t], cache)[:, None] for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(out, 1), tiny(x, tier="T3"), rtol=0, atol=2e-5)


def test_env_backend_fla_leaves_cpu_calls_on_torch(monkeypatch):
    from elastic_ssm.ops import resolve_backend

    monkeypatch.setenv("ELASTIC_SSM_SCAN_BACKEND", "fla")
    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    with pytest.raises(ValueError, match="CUDA tensors only"):
        resolve_backend("fla", torch.zeros(1))


@pytest.mark.parametrize("shape", [(2, 0), (0, 5)])
@pytest.mark.parametrize("arch", ["essh", "es_ssm", "transformer"])
def test_an_empty_input_gets_the_same_refusal_from_every_architecture(arch, shape):
    """Issue 40 item 14: ESSH accepted T = 0 (and returned [B, 0, V]) where ES-SSM refused it."""
    from elastic_ssm.config import TransformerConfig
    from elastic_ssm.models.baselines import TransformerPP

    model = {"essh": lambda: es.ESSH(es.ESSHConfig.preset("tiny")),
             "es_ssm": lambda: es.ESSSM(es.ESSSMConfig.preset("tiny")),
             "transformer": lambda: TransformerPP(TransformerConfig.preset("tiny"))}[arch]()
    with pytest.raises(ValueError, match=rf"^input_ids \({shape[0]}, {shape[1]}\) is empty; pass at least one "
                                         "sequence of at least one token$"):
        model(torch.zeros(shape, dtype=torch.long))


@torch.no_grad()
def test_max_new_tokens_is_a_bound_not_an_allocation(tiny):
    """``generate`` allocated all of ``max_new_tokens`` up front: 10**11 was 'out of memory' (800 GB), 2**63 - 1 an
    overflow, 10**23 a TypeError called a bug; a stop id ends every one of them after the first token, and a
    generation longer than the first block of its output equals the same generation cut shorter."""
    ids = torch.tensor([[1, 2, 3]])
    first = int(tiny.generate(ids, 1)[0, -1])
    for n in (10**11, 2**63 - 1, 10**23):
        assert tiny.generate(ids, n, eos_token_id=first, sync_every=1).shape == (1, 4)
    long = tiny.generate(ids, 1030)
    assert long.shape == (1, 1033) and torch.equal(long[:, :103], tiny.generate(ids, 100))
