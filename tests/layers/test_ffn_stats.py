"""The running activation statistics of ``SwiGLU`` (ESSH D.3): the first tracked full-width step's mean of a_h^2,
then an EMA, held in buffers updated in place (never a new tensor: under ``torch.compile`` with CUDA graphs a new
tensor would be a graph output that the next replay overwrites)."""

import pytest
import torch

from elastic_ssm.layers.ffn import SwiGLU
from elastic_ssm.train.capacity_mixed import enable_tracking


def _reference(acts, decay):
    """The statistics as the layer kept them before they lived in buffers: ``m`` first, then ``mul_``/``add_``."""
    out, stat = [], None
    for a in acts:
        m = a.float().pow(2).reshape(-1, a.shape[-1]).mean(0)
        stat = m if stat is None else stat.mul_(decay).add_(m, alpha=1 - decay)
        out.append(stat.clone())
    return out


def _acts(ffn, xs):
    """The activations a = silu(gate) * up of every input (what ``_update_stats`` reads)."""
    with torch.no_grad():
        return [(lambda g, u: torch.nn.functional.silu(g) * u)(*ffn.w_in(x).unflatten(-1, (ffn.d_ff, 2)).unbind(-1))
                for x in xs]


class _Model(torch.nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.ffn = ffn

    def ffn_layers(self):
        return [self.ffn]


@pytest.mark.parametrize("by_hand", [False, True])
def test_statistics_equal_the_plain_ema_and_stay_in_place(by_hand):
    torch.manual_seed(0)
    ffn = SwiGLU(16, 24).train()
    xs = [torch.randn(3, 5, 16) for _ in range(6)]
    if by_hand:          # tracking switched on without enable_tracking: the first update allocates the buffers
        ffn.track_activations, ffn.stat_decay = True, 0.9
    else:                # enable_tracking allocates them before any (compiled) forward
        enable_tracking(_Model(ffn), True, 0.9)
        assert torch.equal(ffn.stat_sq, torch.zeros(24)) and not ffn.stat_seen
    assert ffn.act_sq is None
    with pytest.raises(RuntimeError, match="no activation statistics yet"):
        ffn.importance()
    want = _reference(_acts(ffn, xs), 0.9)
    ffn(xs[0], n_ff=12)                     # a reduced width leaves them untouched
    assert ffn.act_sq is None
    ptrs = set() if by_hand else {ffn.stat_sq.data_ptr()}
    for x, w in zip(xs, want):
        ffn(x)
        assert torch.equal(ffn.act_sq, w)
        ptrs.add(ffn.act_sq.data_ptr())
    assert len(ptrs) == 1 and "stat_sq" not in ffn.state_dict()
    perm = torch.randperm(24)
    ffn.permute_units(perm)
    assert torch.equal(ffn.act_sq, want[-1][perm])
    ffn.act_sq = None                       # cleared: the next step starts again from its own mean
    ffn(xs[0])
    assert torch.equal(ffn.act_sq, _reference(_acts(ffn, xs[:1]), 0.9)[0])


def test_statistics_set_from_a_checkpoint_continue_the_same_ema():
    torch.manual_seed(1)
    a, b = SwiGLU(8, 12).train(), SwiGLU(8, 12).train()
    b.load_state_dict(a.state_dict())
    for f in (a, b):
        f.track_activations, f.stat_decay = True, 0.95
    xs = [torch.randn(2, 4, 8) for _ in range(4)]
    for x in xs[:2]:
        a(x)
    b.act_sq = a.act_sq.clone().cpu()       # what a checkpoint's rank file holds (also one written before)
    for x in xs[2:]:
        a(x), b(x)
    assert torch.equal(a.act_sq, b.act_sq)


def test_compiled_updates_match_eager():
    torch.manual_seed(2)
    eager = SwiGLU(8, 16).train()
    comp = SwiGLU(8, 16).train()
    comp.load_state_dict(eager.state_dict())
    for f in (eager, comp):
        f.track_activations, f.stat_decay = True, 0.9
        f.start_stats()
    fwd = torch.compile(comp, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        x = torch.randn(2, 4, 8)
        eager(x), fwd(x)
        assert torch.equal(eager.act_sq, comp.act_sq)
