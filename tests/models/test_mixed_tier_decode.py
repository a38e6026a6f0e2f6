"""Rows at different tiers in one fused decode step (``FastDecoder(mixed=True)``, ``layers/decode_plan.py``), CPU.

Each row is prefilled at its own tier into the widest tier's cache (``ESSHCache.at_tier``) and then stepped with
every other row in one step. In float64 every row's logits equal the reference ``ESSH.step`` of a cache at the
row's tier alone (the fused path up to ``MAX_FUSED_BATCH`` rows and the batched path above it); in float32 every
row's greedy tokens equal ``model.generate(..., tier=its tier)`` alone. A row can change tier between sequences.
"""

import pytest
import torch

import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective
from elastic_ssm.models.fast_decode import FastDecoder
from elastic_ssm.ops.gemv import MAX_FUSED_BATCH

F64 = torch.float64


def _model(preset: str, dtype=F64):
    torch.manual_seed(0)
    model = randomize_selective(es.ESSH(es.ESSHConfig.preset(preset, tie_embeddings=False)), 0.3, True)
    return model.to(dtype).eval()


def _prefill_rows(model, fd, prompts, tiers):
    """Each prompt into its row of ``fd``'s cache at its own tier; their next-token logits [B, V]."""
    out = []
    for row, (ids, tier) in enumerate(zip(prompts, tiers)):
        fd.set_row_tier(row, tier)
        view = fd.cache.at_tier(model.resolve_tier(tier)).narrow(1, start=row)
        out.append(model(ids[None], tier=tier, cache=view)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("batch", [3, MAX_FUSED_BATCH + 2])     # the fused-product path and the batched one
@torch.no_grad()
def test_every_row_equals_its_own_tier_step(preset, batch):
    model = _model(preset)
    table = model.tier_table()
    tiers = [table[i % len(table)].name for i in (0, 3, len(table) - 1, 1, 5, 2, 0, 4, 9, 6)][:batch]
    torch.manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (4 + r,)) for r in range(batch)]
    fd = FastDecoder(model, table[-1].name, batch, state_dtype=F64, kv_dtype=F64, backend="torch", mixed=True)
    assert fd.mixed and fd.fused_gemv == (batch <= MAX_FUSED_BATCH)
    refs = []
    for ids, tier in zip(prompts, tiers):       # each row alone, at its tier, through the reference step
        cache = model.allocate_cache(1, tier, state_dtype=F64, kv_dtype=F64)
        refs.append((cache, model(ids[None], tier=tier, cache=cache)[0, -1]))
    got = _prefill_rows(model, fd, prompts, tiers)
    torch.testing.assert_close(got, torch.stack([r[1] for r in refs]), rtol=1e-10, atol=1e-10)
    tokens = torch.randint(0, model.config.vocab_size, (6, batch))
    for t in range(tokens.shape[0]):            # T > window (16) of tiny after the longest prompt: rings wrap
        logits = fd.step(tokens[t])
        want = torch.stack([model.step(tokens[t, r:r + 1], cache)[0] for r, (cache, _) in enumerate(refs)])
        torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9, msg=f"step {t}")


@torch.no_grad()
@pytest.mark.parametrize("batch", [3, MAX_FUSED_BATCH + 2])
def test_in_bf16_rows_at_the_decoders_tier_step_bitwise_like_the_plain_decoder(batch):
    """The per-row factors cost no rounding of their own: with every row at the decoder's tier (factors 1), a mixed
    decoder's bf16 logits equal the plain decoder's bit for bit (the batched path rounds z sqrt(K / K_T) once into
    the weights' dtype and adds in one addmm, as the plain path; before, its extra casts moved logits by 2e-3-8e-3)."""
    model = _model("tiny", torch.bfloat16)
    plain = FastDecoder(model, "T10", batch, backend="torch")
    mixed = FastDecoder(model, "T10", batch, backend="torch", mixed=True)
    with torch.no_grad():
        for tokens in torch.randint(0, model.config.vocab_size, (5, batch)):
            assert torch.equal(plain.step(tokens), mixed.step(tokens))


def test_greedy_rows_equal_generate_alone_in_float32():
    model = _model("tiny", torch.float32)
    tiers = ["T1", "T10", "T4", "T1"]
    torch.manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (5 + 2 * r,)) for r in range(len(tiers))]
    n = 24
    want = [model.generate(ids[None], max_new_tokens=n, tier=t, do_sample=False)[0, len(ids):].tolist()
            for ids, t in zip(prompts, tiers)]
    assert len({tuple(w) for w in want}) > 1          # the tiers do give different text
    fd = FastDecoder(model, "T10", len(tiers), backend="torch", mixed=True)
    logits = _prefill_rows(model, fd, prompts, tiers)
    got = [[] for _ in tiers]
    for _ in range(n):
        tok = logits.argmax(-1)
        for r, v in enumerate(tok.tolist()):
            got[r].append(v)
        logits = fd.step(tok)
    assert got == want


@torch.no_grad()
def test_a_row_changes_tier_between_sequences():
    """A slot freed by a T10 sequence and reused at T1 (reset, then prefilled at T1) decodes T1 exactly."""
    model = _model("tiny")
    fd = FastDecoder(model, "T10", 2, state_dtype=F64, kv_dtype=F64, backend="torch", mixed=True)
    ids = torch.arange(3, 11)
    _prefill_rows(model, fd, [ids, ids], ["T10", "T10"])
    for _ in range(3):
        fd.step(torch.tensor([1, 2]))
    fd.cache.narrow(1, start=0).reset_()
    got = _prefill_rows(model, fd, [ids], ["T1"])[0]
    cache = model.allocate_cache(1, "T1", state_dtype=F64, kv_dtype=F64)
    torch.testing.assert_close(got, model(ids[None], tier="T1", cache=cache)[0, -1])
    step = fd.step(torch.tensor([7, 7]))[0]
    torch.testing.assert_close(step, model.step(torch.tensor([7]), cache)[0], rtol=1e-10, atol=1e-10)


def test_one_line_errors():
    model = _model("tiny")
    single = FastDecoder(model, "T4", 2, backend="torch")
    single.set_row_tier(0, "T4")                       # its own tier: nothing to do
    with pytest.raises(ValueError, match="mixed=True"):
        single.set_row_tier(0, "T1")
    mixed = FastDecoder(model, "T4", 2, backend="torch", mixed=True)
    with pytest.raises(ValueError, match="wider than the decoder's T4"):
        mixed.set_row_tier(0, "T10")
    with pytest.raises(ValueError, match="outside the decoder's 2 rows"):
        mixed.set_row_tier(2, "T1")
    with pytest.raises(ValueError, match="allocate it at the widest tier"):
        model.allocate_cache(1, "T1").at_tier(model.resolve_tier("T10"))
