"""``RingState.write`` of a prompt (T > 1) against the ring's definition: slot ``j mod W`` holds the row's valid
token at position j, for the last W of its n valid (left-padded) tokens; every other slot is empty (zero, -1),
whatever the ring held before. Prompts shorter, as long as and longer than the window."""

import pytest
import torch

from elastic_ssm.layers.attention import RingState


@pytest.mark.parametrize("T", [2, 5, 8, 13])
def test_a_prompt_fills_the_ring_by_its_definition(T):
    torch.manual_seed(T)
    B, H, W, hd = 4, 2, 8, 3
    k, v = torch.randn(B, H, T, hd), torch.randn(B, H, T, hd)
    n = torch.tensor([T, 1, max(1, T - 3), max(1, T // 2)])                        # valid tokens per row
    valid = torch.arange(T)[None, :] >= (T - n)[:, None]                             # left padding [B, T]
    ring = RingState(torch.randn(B, H, W, hd), torch.randn(B, H, W, hd), torch.randint(0, 9, (B, W)),
                     torch.zeros(B, dtype=torch.long))                               # stale contents
    ring.write(k, v, None, valid)
    want_k, want_v = torch.zeros(B, H, W, hd), torch.zeros(B, H, W, hd)
    want_pos = torch.full((B, W), -1)
    for b in range(B):
        for j in range(int(n[b])):                                                   # later positions overwrite
            t = T - int(n[b]) + j
            want_k[b, :, j % W], want_v[b, :, j % W], want_pos[b, j % W] = k[b, :, t], v[b, :, t], j
    assert torch.equal(ring.keys, want_k) and torch.equal(ring.values, want_v)
    assert torch.equal(ring.slot_pos, want_pos)
    full = RingState(torch.randn(B, H, W, hd), torch.randn(B, H, W, hd), torch.zeros(B, W, dtype=torch.long),
                     torch.zeros(B, dtype=torch.long))
    full.write(k, v, None, None)                                                     # no padding: n = T
    assert torch.equal(full.keys[0], ring.keys[0]) and torch.equal(full.slot_pos[0], ring.slot_pos[0])
