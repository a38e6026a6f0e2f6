"""One-token sliding-window attention step (``ops.swa_decode``): the torch path equals
``SlidingWindowAttention.step`` (ring write included), and the Triton kernels (CPU interpreter) equal the
torch path with several window chunks, a partly filled ring and a wrapped ring."""


import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from elastic_ssm.layers.attention import SlidingWindowAttention
from elastic_ssm.ops.swa_decode import rope_inv_freq, swa_decode_step


def _ring(B, H, W, hd, dtype):
    layer = SlidingWindowAttention(H * hd, hd, W)
    return layer.init_state(B, kv_dtype=dtype)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_torch_path_equals_layer_step(attention):
    torch.manual_seed(0)
    B, D, hd, W = 3, 32, 8, 6
    layer = SlidingWindowAttention(D, hd, W).double()
    ref, mine = _ring(B, D // hd, W, hd, torch.float64), _ring(B, D // hd, W, hd, torch.float64)
    inv = rope_inv_freq(hd, layer.rope_base)
    pos = torch.tensor([0, 3, 5])                    # rows start at different positions
    for _ in range(9):                              # the ring wraps (9 + 5 > W)
        x = torch.randn(B, D, dtype=torch.float64)
        ref.positions.copy_(pos)
        want = layer.step(x, ref)
        o = swa_decode_step(F.linear(x, layer.qkv.weight), mine.keys, mine.values, mine.slot_pos, pos, inv,
                            backend="torch", attention=attention)
        torch.testing.assert_close(F.linear(o, layer.out.weight), want, rtol=1e-10, atol=1e-10)
        pos = pos + 1
    torch.testing.assert_close(mine.keys, ref.keys)
    torch.testing.assert_close(mine.slot_pos, ref.slot_pos)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_a_span_reads_only_the_ring_prefix_and_equals_the_whole_ring(attention):
    """``span``: rows shorter than the span attend over the ring's first slots only, with the same output and the
    same ring writes as over the whole ring; a row longer than the span would lose its early tokens (so the
    span is a promise the caller keeps)."""
    torch.manual_seed(1)
    B, H, hd, W = 3, 2, 8, 32
    whole, part = _ring(B, H, W, hd, torch.float64), _ring(B, H, W, hd, torch.float64)
    inv = rope_inv_freq(hd, 1e4)
    pos = torch.tensor([0, 3, 9])
    for _ in range(6):                               # positions up to 14 < span 16
        qkv = torch.randn(B, 3 * H * hd, dtype=torch.float64)
        want = swa_decode_step(qkv, whole.keys, whole.values, whole.slot_pos, pos, inv, attention=attention)
        got = swa_decode_step(qkv, part.keys, part.values, part.slot_pos, pos, inv, attention=attention, span=16)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        pos = pos + 1
    assert torch.equal(part.keys, whole.keys) and torch.equal(part.slot_pos, whole.slot_pos)
    qkv = torch.randn(B, 3 * H * hd, dtype=torch.float64)
    want = swa_decode_step(qkv, whole.keys, whole.values, whole.slot_pos, pos, inv, attention=attention)
    short = swa_decode_step(qkv, part.keys, part.values, part.slot_pos, pos, inv, attention=attention, span=4)
    assert not torch.allclose(short[2], want[2])     # row 2 at position 15 > span 4: its early slots are skipped
    with pytest.raises(ValueError, match="span must be"):
        swa_decode_step(qkv, part.keys, part.values, part.slot_pos, pos, inv, span=0)


def test_bad_shapes_are_named():
    c = _ring(2, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="need qkv"):
        swa_decode_step(torch.randn(2, 40), c.keys, c.values, c.slot_pos, torch.zeros(2, dtype=torch.long),
                        rope_inv_freq(8, 1e4))
    with pytest.raises(ValueError, match="keys/values must both be"):
        swa_decode_step(torch.randn(2, 48), c.keys, c.values[:, :1], c.slot_pos,
                        torch.zeros(2, dtype=torch.long), rope_inv_freq(8, 1e4))


_INTERPRETER_CHECK = """
import torch
from elastic_ssm.ops.swa_decode import rope_inv_freq, swa_decode_step

torch.manual_seed(0)
B, H, W, hd = 3, 2, 64, 16
inv = rope_inv_freq(hd, 10000.0)
for kv_dtype in (torch.float32, torch.bfloat16):
    caches = []
    for _ in range(2):
        k, v = torch.randn(B, H, W, hd).to(kv_dtype), torch.randn(B, H, W, hd).to(kv_dtype)
        caches.append([k, v])
    caches[1] = [t.clone() for t in caches[0]]
    sp0 = torch.full((B, W), -1, dtype=torch.long)
    sp0[1, :20] = torch.arange(20)                  # row 1: 20 tokens so far
    sp0[2] = torch.arange(1000, 1000 + W)           # row 2: a wrapped ring
    sps = [sp0.clone(), sp0.clone()]
    pos = torch.tensor([0, 20, 1000 + W])
    for step in range(5):
        qkv = torch.randn(B, 3 * H * hd)
        o_t = swa_decode_step(qkv, *caches[0], sps[0], pos, inv, backend="torch", out_dtype=torch.float32)
        o_k = swa_decode_step(qkv, *caches[1], sps[1], pos, inv, backend="triton", chunk=16,
                              out_dtype=torch.float32)
        err = ((o_k - o_t).norm() / o_t.norm()).item()
        assert err < (1e-5 if kv_dtype == torch.float32 else 1e-2), (kv_dtype, step, err)
        assert torch.equal(sps[0], sps[1])
        tol = 1e-5 if kv_dtype == torch.float32 else 1e-2          # bf16: one rounding step apart at most
        for a, b in zip(caches[0], caches[1]):
            torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=1e-5)
        pos = pos + 1
# span: rows shorter than 32 slots (two of the four 16-slot chunks) against the torch path over the whole ring
caches = [[torch.randn(B, H, W, hd) for _ in range(2)] for _ in range(2)]
caches[1] = [t.clone() for t in caches[0]]
sp0 = torch.full((B, W), -1, dtype=torch.long)
sp0[1, :20] = torch.arange(20)
sps = [sp0.clone(), sp0.clone()]
pos = torch.tensor([0, 20, 5])
for step in range(8):                               # positions up to 27 < 32
    qkv = torch.randn(B, 3 * H * hd)
    o_t = swa_decode_step(qkv, *caches[0], sps[0], pos, inv, backend="torch", out_dtype=torch.float32)
    o_k = swa_decode_step(qkv, *caches[1], sps[1], pos, inv, backend="triton", chunk=16, span=32,
                          out_dtype=torch.float32)
    assert ((o_k - o_t).norm() / o_t.norm()).item() < 1e-5, step
    assert torch.equal(sps[0], sps[1])
    for a, b in zip(caches[0], caches[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    pos = pos + 1
print("ok")
"""


def test_triton_kernels_in_interpreter():
    run_interpreted(_INTERPRETER_CHECK)
