"""Channel importance profile of a spectral model (ESSH Appendix L.3, Table 31, Figure 10; docs/evaluation.md), per
channel ``k`` of a tier on the same held-out batches: the **knock-out** perplexity increase after zeroing channel
``k``'s output columns in every spectral layer and its **output energy**, the mean squared contribution to the mixer
output (ESSH ``K^{-1/2} W_k^out z_k``, Sec. 4.1; ES-SSM ``g_k M_k (Phi_k * u)``, Eq. 3/4), with Table 31's summaries."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..config import TierLike
from ..utils.progress import format_table, pyplot, save_png
from ..utils.progress import progress as progress_bar
from .perplexity import eval_mode, loss_sums, perplexity

__all__ = ["ChannelImportance", "ImportanceResult", "channel_importance", "has_spectral_channels", "ordering",
           "first_share", "format_importance", "plot_importance"]


@dataclass
class ChannelImportance:
    channel: int            # 1-based channel index k
    knockout_loss: float    # mean CE in nats with channel k zeroed
    loss_increase: float    # knockout_loss - base loss (nats)
    delta_ppl: float        # knock-out perplexity - base perplexity
    delta_bpb: float        # knock-out bits per byte - base bits per byte
    energy: float           # mean squared activation of the channel's contribution


@dataclass
class ImportanceResult:
    tier: str
    K: int
    params: int
    base_loss: float
    base_ppl: float
    base_bpb: float
    tokens: int
    first: int
    ordering_knockout: float   # -Spearman(k, delta_ppl_k)
    ordering_energy: float     # -Spearman(k, energy_k)
    share_knockout: float      # first-``first`` share of the knock-out increase
    share_energy: float        # first-``first`` share of the output energy
    channels: list[ChannelImportance] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "channels"}

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(c) for c in self.channels]


def ordering(values: Sequence[float]) -> float:
    """``-Spearman(k, values_k)`` over k = 1..len(values) (Table 31); NaN when ``values`` is constant."""
    from scipy.stats import spearmanr

    if len(values) < 2 or len(set(values)) == 1:
        return float("nan")
    return 0.0 - float(spearmanr(range(1, len(values) + 1), values).statistic)   # never -0.0


def first_share(values: Sequence[float], first: int = 8) -> float:
    """Share of the first ``first`` entries in the total, negative entries counted as 0 (NaN if all are)."""
    pos = [max(float(v), 0.0) for v in values]
    total = sum(pos)
    return sum(pos[:first]) / total if total > 0 else float("nan")


def _channel_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """``(output weight name, spectral layer, columns per channel)`` of every spectral layer: ESSH
    ``out_proj.weight`` [D, K P], ES-SSM ``proj.weight`` [D, K D] (M_k)."""
    from ..layers.es_ssm import SpectralSublayer
    from ..layers.spectral_mixer import SpectralMixer

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, SpectralMixer):
            out.append((f"{name}.out_proj.weight", mod, mod.P))
        elif isinstance(mod, SpectralSublayer):
            out.append((f"{name}.proj.weight", mod, mod.d_model))
    return out


def has_spectral_channels(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a spectral layer (ESSH or ES-SSM), whose channels ``channel_importance`` measures."""
    return bool(_channel_layers(model))


@contextmanager
def _energy_meter(layers: list[tuple[str, torch.nn.Module, int]], K: int) -> Iterator[Callable[[], list[float]]]:
    """Each channel's output energy [K] over the spectral layers of the forwards inside the block: ESSH wraps the
    mixer's readout (``SpectralMixer.channel_energy`` of ``z [.., K, P]``), ES-SSM hooks ``channel_outputs``
    [B, T, K, D]. Yields ``energy()``: per layer the mean over positions, averaged over the spectral layers."""
    from ..layers.spectral_mixer import SpectralMixer

    sums = torch.zeros(len(layers), K, dtype=torch.float64)
    counts = torch.zeros(len(layers), dtype=torch.float64)

    def add(i: int, energy: torch.Tensor, n: int) -> None:
        sums[i] += energy.detach().double().cpu()
        counts[i] += n

    with ExitStack() as undo:
        for i, (_, mod, _per) in enumerate(layers):
            if isinstance(mod, SpectralMixer):
                def wrapped(z, K, _i=i, _mod=mod, _readout=mod._readout):
                    n = z[..., 0, 0].numel()                                   # positions in this call
                    add(_i, _mod.channel_energy(z, K) * n / (K * _mod.D), n)
                    return _readout(z, K)

                mod._readout = wrapped
                undo.callback(delattr, mod, "_readout")
            else:
                def hook(mod, args, _out, _i=i):
                    u, K = args[0], (args[1] if len(args) > 1 and args[1] is not None else mod.n_channels)
                    c = mod.channel_outputs(u, K).float()                      # [B, T, K, D]
                    add(_i, c.square().mean(dim=(0, 1, 3)), c.shape[0] * c.shape[1])

                undo.callback(mod.register_forward_hook(hook).remove)
        yield lambda: (sums / counts.clamp(min=1)[:, None]).mean(0).tolist()


@torch.no_grad()
def channel_importance(model: Any, batches: Sequence[tuple[torch.Tensor, ...]], tier: TierLike = None,
                       bytes_per_token: float = 1.0, first: int = 8, precision: str = "fp32",
                       progress: bool = False) -> ImportanceResult:
    """Knock-out and energy profile of every channel of ``tier`` on ``batches`` (as for ``evaluate_tiers``;
    module docstring, Table 31): K + 1 evaluations."""
    layers = _channel_layers(model)
    if not layers:
        raise ValueError(f"channel importance needs spectral channels (ESSH or ES-SSM); this "
                         f"{getattr(model, 'arch', type(model).__name__)!r} model has no spectral layer")
    if first < 1:
        raise ValueError(f"first must be >= 1, got {first}")
    t = model.resolve_tier(tier)
    K = t.K
    if first > K:
        raise ValueError(f"first={first} exceeds the {K} channels of tier {t.name}; give first <= {K}")
    with eval_mode(model):
        with _energy_meter(layers, K) as energy:
            base = loss_sums(model, batches, t, precision)
        count = int(base[1].item())
        base_loss = base[0].item() / count
        weights = {name: (model.get_parameter(name), per) for name, _, per in layers}   # [D, K per] each
        channels = []
        for k in progress_bar(range(K), desc="knock-out", unit="channel", enabled=progress):
            knocked = {name: w.index_fill(1, torch.arange(k * per, (k + 1) * per, device=w.device), 0)
                       for name, (w, per) in weights.items()}
            loss = loss_sums(model, batches, t, precision, params=knocked)[0].item() / count
            channels.append(ChannelImportance(k + 1, loss, loss - base_loss, perplexity(loss) - perplexity(base_loss),
                                              (loss - base_loss) / math.log(2) / bytes_per_token, 0.0))
    for c, e in zip(channels, energy()):
        c.energy = e
    knock, energy = [c.delta_ppl for c in channels], [c.energy for c in channels]
    return ImportanceResult(t.name, K, t.params, base_loss, perplexity(base_loss),
                            base_loss / math.log(2) / bytes_per_token, count, first,
                            ordering(knock), ordering(energy), first_share(knock, first), first_share(energy, first),
                            channels)


def format_importance(res: ImportanceResult) -> str:
    """The per-channel table and the Table 31 summary as text."""
    total = sum(c.energy for c in res.channels) or float("nan")
    lines = [format_table([{"k": c.channel, "knock-out dPPL": f"{c.delta_ppl:.4f}", "dbpb": f"{c.delta_bpb:.4f}",
                            "energy": f"{c.energy:.4g}", "energy share": f"{c.energy / total:.3f}"}
                           for c in res.channels], ["k", "knock-out dPPL", "dbpb", "energy", "energy share"],
                          title=f"channel importance at {res.tier} (K={res.K}, {res.params:,} parameters) on "
                                f"{res.tokens:,} tokens: base ppl {res.base_ppl:.4f}, bpb {res.base_bpb:.4f}")]
    lines += ["", f"{'':<22}{'energy':>10}{'knock-out':>11}",
              f"{'-Spearman(k, imp_k)':<22}{res.ordering_energy:>10.3f}{res.ordering_knockout:>11.3f}",
              f"{f'first-{res.first} share':<22}{res.share_energy:>10.3f}{res.share_knockout:>11.3f}"]
    return "\n".join(lines)


def plot_importance(res: ImportanceResult, path: Any) -> str | None:
    """Figure 10 (a, b) as a PNG at ``path``: knock-out increase per channel and the cumulative shares of
    knock-out and energy. Returns None when written, else why it was skipped (matplotlib missing)."""
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install 'elastic-ssm[plot]')"
    ks = [c.channel for c in res.channels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(ks, [c.delta_ppl for c in res.channels], color="tab:blue")
    a.set(xlabel="channel k", ylabel="validation PPL increase after zeroing k",
          title=f"(a) knock-out, -Spearman {res.ordering_knockout:.2f}")
    for vals, label in (([max(c.delta_ppl, 0.0) for c in res.channels], "knock-out"),
                        ([c.energy for c in res.channels], "output energy")):
        total = sum(vals) or float("nan")
        cum = [sum(vals[:i + 1]) / total for i in range(len(vals))]
        b.plot(ks, cum, "o-", label=label, markersize=3)
    b.axvline(res.first, color="gray", linestyle=":")
    b.set(xlabel="channel k", ylabel="cumulative share",
          title=f"(b) first-{res.first} share: knock-out {res.share_knockout:.2f}, energy {res.share_energy:.2f}")
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle(f"channel importance at {res.tier} (ESSH App. L.3)")
    save_png(fig, path)
    return None
