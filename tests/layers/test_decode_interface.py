"""The layer decode interface (init_state / step / decode_plan) and ``generate`` on top of it (CPU).

For every tier of the ``tiny`` and ``small`` presets (float64): each mixer's ``step`` equals its ``forward``
one token at a time, also after a prefill through ``mix(state=...)``; the fused decoder (torch path) over
the layers' plans equals the reference ``ESSH.step``; ``generate`` equals the greedy argmax of the full
forward, on both decode paths, and left-padded rows equal their unpadded runs. Bad input gets one-line
errors.
"""

import copy

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.layers.attention import SlidingWindowAttention
from elastic_ssm.layers.spectral_mixer import SpectralMixer
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import FastDecoder, batch_bucket, decoder_pool
from elastic_ssm.models.generation import sample_next

F64 = torch.float64


@pytest.fixture(scope="module", params=["tiny", "small"])
def model(request):
    torch.manual_seed(0)
    cfg = es.ESSHConfig.preset(request.param)
    return randomize_selective(es.ESSH(cfg).to(F64).eval(), ffn_out_std=0.1, zero_lag=True)


def _positions(B, T):
    return torch.arange(T).expand(B, T)


@torch.no_grad()
def test_every_mixer_step_equals_its_forward(model):
    """Per layer and tier: prefill 5 tokens into the layer's own state, then step the rest == forward."""
    B, T, T0 = 2, 20, 5                      # T > window of tiny (16): the ring wraps
    for tier in model.tier_table():
        for block in model.blocks:
            mixer = block.mixer
            u = torch.randn(B, T, model.config.d_model, dtype=F64)
            want = mixer.mix(u, tier, _positions(B, T))
            positions = torch.zeros(B, dtype=torch.long)
            state = mixer.init_state(B, tier, state_dtype=F64, kv_dtype=F64, positions=positions)
            got = [mixer.mix(u[:, :T0], tier, _positions(B, T0), None, state)]
            positions += T0
            for t in range(T0, T):
                got.append(mixer.step(u[:, t], state, tier)[:, None])
                positions += 1
            torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-10, atol=1e-10,
                                       msg=f"{type(mixer).__name__} at {tier.name}")


def test_init_state_sizes_follow_the_tier(model):
    cfg = model.config
    for tier in model.tier_table():
        cache = model.allocate_cache(3, tier)
        assert cache.nbytes() == es.elastic.state_bytes(cfg, tier.name, batch=3, state_dtype_bytes=8,
                                                        kv_dtype_bytes=8)
        for i, s in cache.states.items():
            assert s.shape == (3, tier.K, cfg.n_modes, 2, cfg.value_width)
            assert isinstance(model.blocks[i].mixer, SpectralMixer)
        for i, r in cache.rings.items():
            assert r.keys.shape == (3, cfg.n_heads, cfg.window, cfg.head_dim)
            assert r.positions is cache.positions and isinstance(model.blocks[i].mixer, SlidingWindowAttention)


def test_decode_plans_are_prefix_views(model):
    tier = model.tier_table()[0]
    c = model.config
    for block in model.blocks:
        plan = block.mixer.decode_plan(tier, torch.float32)
        w_in, w_out = (block.mixer.in_proj, block.mixer.out_proj) if block.kind == "S" else (block.mixer.qkv,
                                                                                             block.mixer.out)
        assert plan.w_in.data_ptr() == w_in.weight.data_ptr() and plan.w_out_rows.data_ptr() == w_out.weight.data_ptr()
        if block.kind == "S":   # a column prefix of out_proj.weight [D, K P], read in place
            assert plan.w_out_rows.shape == (c.d_model, tier.K * c.value_width) and plan.w_out_split is None
        ffn = block.ffn.decode_plan(tier)
        assert ffn.w_in.shape == (2 * tier.n_ff, c.d_model) and ffn.w_out_rows.shape == (c.d_model, tier.n_ff)
        assert ffn.w_in.data_ptr() == block.ffn.w_in.weight.data_ptr() and ffn.w_out_split is None
        assert ffn.w_out_rows.data_ptr() == block.ffn.w_out.weight.data_ptr()
        split = block.ffn.decode_plan(tier, split_copy=True).w_out_split       # the split kernel's in x out copy
        assert split.is_contiguous() and torch.equal(split, ffn.w_out_rows.t())


@pytest.mark.parametrize("gemv", ["fused", "cublas"])
def test_fused_decoder_equals_reference_step_every_tier(model, gemv):
    ids = torch.randint(0, 256, (2, 24))
    for tier in model.tier_table():
        ref = model.allocate_cache(2, tier)
        with torch.no_grad():
            model(ids, tier=tier, cache=ref)
        fd = FastDecoder(model, tier, 2, cache=copy.deepcopy(ref), backend="torch", gemv=gemv)
        tok = ids[:, -1]
        for _ in range(4):
            want = model.step(tok, ref)
            torch.testing.assert_close(fd.step(tok), want, rtol=1e-9, atol=1e-9, msg=tier.name)
            tok = want.argmax(-1)


def test_fused_decoder_with_attended_spans_equals_reference_step(model):
    """``step(tokens, span=n)`` with n = the rows' length + 1: the window attention reads a power-of-two prefix
    of the ring (8, 16, 32, ... slots, then the whole ring once the rows outgrow the largest span) and every
    step equals the reference ``ESSH.step``."""
    W = model.config.window
    ids = torch.randint(0, 256, (2, 5))
    ref = model.allocate_cache(2, "T4")
    with torch.no_grad():
        model(ids, tier="T4", cache=ref)
    fd = FastDecoder(model, "T4", 2, cache=copy.deepcopy(ref), backend="torch", min_span=8)
    assert fd.spans == [s for s in (8, 16, 32, 64) if s < W]
    assert fd.span_for(5) == 8 and fd.span_for(9) == (16 if W > 16 else None) and fd.span_for(None) is None
    tok, used = ids[:, -1], set()
    for n in range(5, W + 6):                       # past the window: the ring wraps
        want = model.step(tok, ref)
        used.add(fd.span_for(n + 1))
        torch.testing.assert_close(fd.step(tok, span=n + 1), want, rtol=1e-9, atol=1e-9, msg=str(n))
        tok = want.argmax(-1)
    assert used == {*fd.spans, None}


def test_generate_passes_attended_spans_above_the_span_batch(model, monkeypatch):
    """``generate``'s fused session (batch above ``SPAN_MIN_BATCH``) steps over the span of the prompt's padded
    length + the steps so far, crossing every span of the decoder, and equals the reference step's greedy text
    (left-padded rows of different lengths included)."""
    import elastic_ssm.models.fast_decode as engine

    W = model.config.window
    monkeypatch.setattr(engine, "SPAN_MIN_BATCH", 0)
    pool = decoder_pool(model)
    pool.clear()
    monkeypatch.setattr(pool, "min_span", 8)
    ids = torch.randint(1, 256, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                                   # a left-padded row
    asked = []
    step = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, tokens, span=None: asked.append(self.span_for(span))
                        or step(self, tokens, span=span))
    n = W + 4 - ids.shape[1]                          # up to past the window: every span, then the whole ring
    got = model.generate(ids, n, tier="T4", attention_mask=mask, fast=True)
    want = model.generate(ids, n, tier="T4", attention_mask=mask, fast=False)
    assert torch.equal(got, want)
    assert set(asked) == {*[s for s in (8, 16, 32, 64) if s < W], None}
    pool.clear()


@pytest.mark.parametrize("fast", [False, True])
def test_generate_equals_greedy_forward_argmax_every_tier(model, fast):
    ids = torch.randint(0, 256, (2, 9))
    for tier in model.tier_table():
        out = model.generate(ids, 8, tier=tier, fast=fast)
        logits = model(out, tier=tier)
        assert torch.equal(out[:, 10:], logits[:, 9:-1].argmax(-1)), tier.name
        assert torch.equal(out[:, 9], logits[:, 8].argmax(-1))


@pytest.mark.parametrize("fast", [False, True])
def test_left_padded_batch_equals_unpadded_rows(model, fast):
    torch.manual_seed(3)
    lengths = [3, 11, 7]
    rows = [torch.randint(0, 256, (n,)) for n in lengths]
    W = max(lengths)
    ids = torch.zeros(3, W, dtype=torch.long)
    mask = torch.zeros(3, W, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, W - len(r):], mask[i, W - len(r):] = r, 1
    batch = model.generate(ids, 10, tier="T3", attention_mask=mask, fast=fast)
    for i, r in enumerate(rows):
        assert torch.equal(batch[i, W:], model.generate(r[None], 10, tier="T3", fast=fast)[0, len(r):])


def test_pooled_decoders_are_reused_and_rebuilt_after_a_weight_update():
    torch.manual_seed(1)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset("tiny")).eval())
    pool = decoder_pool(model)
    ids = torch.randint(0, 256, (3, 5))
    first = model.generate(ids, 4, tier="T2", fast=True)
    fd = pool.get("T2", 3)
    assert fd.batch == batch_bucket(3) == 4 and len(pool.info()) == 1
    assert torch.equal(model.generate(ids, 4, tier="T2", fast=True), first)
    model.generate(ids[:1], 4, tier="T5", fast=True)          # another tier and bucket: a second decoder
    assert pool.get("T2", 4) is fd and len(pool.info()) == 2
    with torch.no_grad():
        model.blocks[0].mixer.rho_raw.add_(1.0)                # in place: the modal constants change
    assert pool.get("T2", 3) is not fd
    assert torch.equal(model.generate(ids, 4, tier="T2", fast=True), model.generate(ids, 4, tier="T2", fast=False))


def test_eos_stops_early_and_pads(model):
    ids = torch.randint(0, 256, (2, 6))
    free = model.generate(ids, 6, tier="T1")
    eos = int(free[0, 7])                                   # row 0 emits it by its second new token
    first = [int((r[6:] == eos).nonzero()[0]) if (r[6:] == eos).any() else None for r in free]
    out = model.generate(ids, 40, tier="T1", eos_token_id=eos, sync_every=4)
    assert torch.equal(out[:, :6 + first[0] + 1], free[:, :6 + first[0] + 1])
    assert (out[0, 6 + first[0]:] == eos).all()             # padded with eos after it (pad defaults to eos)
    one = model.generate(ids[:1], 40, tier="T1", eos_token_id=eos, sync_every=4)
    assert one.shape[1] == 6 + first[0] + 1                 # cut right after the step where every row is done
    padded = model.generate(ids[:1], 40, tier="T1", eos_token_id=eos, pad_token_id=3)
    assert padded.shape == one.shape and int(padded[0, -1]) == eos


def test_sampling_is_greedy_by_default_and_reproducible(model):
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(model.generate(ids, 5), model.generate(ids, 5, temperature=0.0))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = model.generate(ids, 6, do_sample=True, top_k=20, top_p=0.9, generator=g1)
    b = model.generate(ids, 6, temperature=1.0, top_k=20, top_p=0.9, generator=g2)
    assert torch.equal(a, b)


def test_exponential_race_samples_the_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).expand(20000, 4)
    counts = torch.bincount(sample_next(logits, 1.0), minlength=4).double() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=F64), atol=0.015, rtol=0)
    nucleus = torch.bincount(sample_next(logits, 1.0, top_p=0.6), minlength=4).double() / 20000
    assert nucleus[2] == 0 and nucleus[3] == 0 and abs(nucleus[0] - 0.625) < 0.015


@pytest.mark.parametrize("kwargs,match", [
    ({"top_p": 0.0}, "top_p must lie in"), ({"top_p": 1.5}, "top_p must lie in"),
    ({"top_k": -1}, "top_k must be"), ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": -1.0}, "temperature must be"), ({"eos_token_id": 10**6}, "eos_token_id must be"),
    ({"max_new_tokens": -2}, "max_new_tokens must be"), ({"fast": "yes"}, "fast must be"),
    ({"sync_every": 0}, "sync_every must be"),
])
def test_bad_generation_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **{"max_new_tokens": 2, **kwargs})


def test_bad_decoding_input_is_named(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="unsupported argument.*num_beams"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, num_beams=4)
    fd = FastDecoder(model, "T2", 2, backend="torch")
    with pytest.raises(ValueError, match=r"1 <= B <= 2"):
        fd.step(torch.zeros(3, dtype=torch.long))               # larger than the decoder's batch
    with pytest.raises(ValueError, match="cache is for batch 2 at T2"):
        FastDecoder(model, "T4", 2, cache=fd.cache)              # a tier the cache was not built for
    with pytest.raises(ValueError, match="cannot take 3 rows"):
        fd.cache.narrow(3)


@pytest.mark.parametrize("lengths", [[256, 256], [5, 300, 77]])
def test_prefill_graph_function_equals_reference_prefill(model, lengths):
    """The static-buffer prefill that ``PrefillGraph`` captures (run eagerly here): left padding to the length
    bucket, extra rows of the batch bucket, positions and layer states equal the reference prefill."""
    from elastic_ssm.models.compile import length_bucket
    from elastic_ssm.models.fast_decode import FusedSession

    assert [length_bucket(t) for t in (1, 256, 257, 2048, 2049, 131072)] == [256, 256, 512, 2048, 2304, 131072]
    torch.manual_seed(5)
    W = max(lengths)
    ids = torch.zeros(len(lengths), W, dtype=torch.long)
    mask = torch.zeros(len(lengths), W, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, W - n:], mask[i, W - n:] = torch.randint(0, 256, (n,)), 1
    mask = None if len(set(lengths)) == 1 else mask
    session = FusedSession(model, len(lengths), "T2", None, None)
    got = session.prefill(ids, mask, graph=False)
    ref = model.allocate_cache(len(lengths), "T2")
    with torch.no_grad():
        want = model(ids, tier="T2", attention_mask=mask, cache=ref)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    rows = session.fd.cache.narrow(len(lengths))
    assert torch.equal(rows.positions, ref.positions)
    for mine, theirs in zip(rows.layers, ref.layers):
        for a, b in ([(mine, theirs)] if isinstance(mine, torch.Tensor) else
                     [(mine.keys, theirs.keys), (mine.slot_pos, theirs.slot_pos)]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    tok = want.argmax(-1)
    torch.testing.assert_close(session.step(tok), model.step(tok, ref), rtol=1e-9, atol=1e-9)


def test_cache_batch_edits_follow_the_rows(model):
    """``ESSHCache.apply_`` (beam reorder / selection / repetition, as the HF cache uses it) keeps each row's
    states, rings and position together: stepping the edited cache equals stepping caches of those rows."""
    ids = torch.randint(0, 256, (2, 7))
    cache = model.allocate_cache(2, "T3")
    with torch.no_grad():
        model(ids, tier="T3", cache=cache)
    order = torch.tensor([1, 0, 1])
    cache.apply_(lambda t: t.index_select(0, order))
    assert cache.batch == 3 and all(r.positions is cache.positions for r in cache.rings.values())
    want = model.allocate_cache(3, "T3")
    with torch.no_grad():
        model(ids[order], tier="T3", cache=want)
    tok = torch.tensor([5, 6, 7])
    torch.testing.assert_close(model.step(tok, cache), model.step(tok, want), rtol=1e-10, atol=1e-10)


def test_reference_step_names_bad_token_ids(model):
    cache = model.allocate_cache(2, "T1")
    for bad, match in ((torch.tensor([1.0, 2.0]), "integer token id"), (torch.tensor([1, 2, 3]), r"tokens \[B=2\]"),
                       (torch.tensor([1, 10**6]), "token ids must lie in")):
        with pytest.raises(ValueError, match=match):
            model.step(bad, cache)
    with pytest.raises(ValueError, match="integer ids"):
        FastDecoder(model, "T1", 2, backend="torch").step(torch.tensor([1.0, 2.0]))


def test_models_report_device_and_dtype():
    model = es.ESSH(es.ESSHConfig.preset("tiny"))
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.to(F64).dtype == F64
    es_ssm = es.ESSSM(es.ESSSMConfig.preset("tiny"))
    assert es_ssm.device.type == "cpu" and es_ssm.dtype == torch.float32


def test_generate_prefills_from_a_graph_on_cuda_up_to_graph_tokens(model, monkeypatch):
    """On CUDA an eager model's prompt is prefilled from a CUDA graph while its padded tokens (batch bucket x length
    bucket) are at most ``GRAPH_TOKENS`` (2,048: 1 x 2048, 8 x 256), eagerly above; a compiled model always; the CPU
    never (the rule of ``FusedSession.uses_prefill_graph``; the graph itself runs in the GPU tests)."""
    from types import SimpleNamespace

    from elastic_ssm.models import compile as compile_mod
    from elastic_ssm.models.compile import GRAPH_TOKENS
    from elastic_ssm.models.fast_decode import FusedSession

    session = FusedSession(model, 1, "T2", None, None)
    assert GRAPH_TOKENS == 2048 and not session.uses_prefill_graph(16)            # CPU: eager
    session.fd = SimpleNamespace(device=torch.device("cuda"), batch=1)
    assert session.uses_prefill_graph(2048) and session.uses_prefill_graph(5)
    assert not session.uses_prefill_graph(2049) and not session.uses_prefill_graph(None)
    session.fd = SimpleNamespace(device=torch.device("cuda"), batch=8)
    assert session.uses_prefill_graph(256) and not session.uses_prefill_graph(300)
    monkeypatch.setattr(compile_mod, "compiled_trunk", lambda m: object())
    monkeypatch.setattr("elastic_ssm.models.fast_decode.compiled_trunk", lambda m: object())
    assert session.uses_prefill_graph(131072)                                     # compiled: every length


def test_a_failing_prefill_capture_of_an_eager_model_falls_back_to_eager(model, monkeypatch):
    """A capture that fails (a kernel this stack cannot capture) warns once and the prompt is prefilled eagerly, as
    every later one; the result equals the reference prefill."""
    from elastic_ssm.models.fast_decode import FusedSession

    session = FusedSession(model, 1, "T2", None, None)
    monkeypatch.setattr(FusedSession, "uses_prefill_graph", lambda self, length=None: self.pool.eager_graphs)
    monkeypatch.setattr(session.pool, "prefill_graph", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    ids = torch.randint(0, 256, (1, 12))
    with pytest.warns(UserWarning, match="capturing a prefill graph failed .RuntimeError: no.; prefilling eagerly"):
        got = session.prefill(ids, None)
    assert not session.pool.eager_graphs and not session.uses_prefill_graph(12)
    ref = model.allocate_cache(1, "T2")
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids, tier="T2", cache=ref)[:, -1], rtol=1e-9, atol=1e-9)
    session.pool.eager_graphs = True
