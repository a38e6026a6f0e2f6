"""The flash-linear-attention peers of ``elastic-ssm bench`` (``elastic_ssm.bench.decode.fla_peers`` loads this
module): Gated DeltaNet and Mamba-2 between SwiGLU blocks (ESSH E.6), their FFN width matched by Table 54's rule."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from elastic_ssm.bench.decode import GraphedStep, PeerUnavailable, match_ffn_width
from elastic_ssm.config import ESSHConfig
from elastic_ssm.elastic.tiers import resolve_tier
from elastic_ssm.layers.ffn import RMSNorm, SwiGLU
from elastic_ssm.utils.environment import library_versions

__all__ = ["require_fla", "fla_training_refused", "FlaFFNModel", "fla_matched", "build_fla", "FlaDecoder"]


def require_fla(kind: str) -> None:
    """Raise ``PeerUnavailable`` unless fla (and, for Mamba-2, its mamba_ssm fast path) imports."""
    libs = library_versions()
    if libs["fla"] is None or str(libs["fla"]).startswith("import failed"):
        raise PeerUnavailable(f"flash-linear-attention not usable ({libs['fla']}): "
                              "pip install flash-linear-attention")
    if kind == "mamba2" and libs["mamba_ssm"] is None:
        raise PeerUnavailable("fla's Mamba-2 layer is fast only with mamba_ssm installed; "
                              "not timed on its fallback")


def fla_training_refused(kind: str) -> str | None:
    """fla's own refusal to train ``kind`` on this device, as a sentence, else None (the Gated DeltaNet backward on
    Hopper with Triton in [3.4.0, 3.7.1) without tilelang, fla issue #640; docs/performance.md)."""
    if kind != "gated_deltanet" or importlib.util.find_spec("tilelang") is not None:
        return None
    try:
        from fla import utils as fu
    except Exception:  # fla absent or broken: require_fla reports it
        return None
    if (getattr(fu, "IS_NVIDIA_HOPPER", False) and getattr(fu, "TRITON_ABOVE_3_4_0", False)
            and not getattr(fu, "TRITON_ABOVE_3_7_1", True)):
        return ("fla refuses the Gated DeltaNet backward on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong "
                "gradients, fla issue #640); install triton>=3.7.1 or tilelang to time its training")
    return None


def _fla_mixer(kind: str, d: int, layer_idx: int) -> nn.Module:
    """fla's mixer at the shapes of its own ~1.3B configs: GDN key width ~0.75 d, value 2x; Mamba-2
    expand 2, head dim 64, state 128 (official settings kept fixed, Table 54)."""
    if kind == "gated_deltanet":
        from fla.layers import GatedDeltaNet

        hd = 256 if d >= 2048 else max(16, min(128, d // 8))
        return GatedDeltaNet(hidden_size=d, expand_v=2, head_dim=hd, num_heads=max(1, round(0.75 * d / hd)),
                             mode="chunk", layer_idx=layer_idx)
    if kind == "mamba2":
        from fla.layers import Mamba2

        hd = 64 if d >= 256 else 16
        return Mamba2(num_heads=2 * d // hd, head_dim=hd, hidden_size=d, state_size=128, expand=2, n_groups=1,
                      layer_idx=layer_idx)
    raise ValueError(f"unknown fla peer {kind!r}; choose 'gated_deltanet' or 'mamba2'")


class FlaFFNModel(nn.Module):
    """fla mixer + SwiGLU blocks (pre-norm), tied embedding: ``forward(ids, cache=None) -> logits``."""

    def __init__(self, kind: str, vocab: int, d: int, n_layers: int, d_ff: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.kind, self.vocab_size, self.d_model, self.n_layers, self.d_ff = kind, vocab, d, n_layers, d_ff
        self.embed = nn.Embedding(vocab, d)
        self.mixers = nn.ModuleList(_fla_mixer(kind, d, i) for i in range(n_layers))
        self.norms = nn.ModuleList(RMSNorm(d, eps) for _ in range(2 * n_layers))
        self.ffns = nn.ModuleList(SwiGLU(d, d_ff) for _ in range(n_layers))
        self.norm_f = RMSNorm(d, eps)

    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, (mixer, ffn) in enumerate(zip(self.mixers, self.ffns)):
            h = mixer(self.norms[2 * i](x), past_key_values=cache, use_cache=cache is not None)[0]
            x = x + h
            x = x + ffn(self.norms[2 * i + 1](x))
        return F.linear(self.norm_f(x), self.embed.weight)


def _fla_params(kind: str, cfg: ESSHConfig, d_ff: int) -> int:
    with torch.device("meta"):
        mixer = _fla_mixer(kind, cfg.d_model, 0)
    per_mixer = sum(p.numel() for p in mixer.parameters())
    d, N = cfg.d_model, cfg.n_layers
    return cfg.vocab_size * d + N * (per_mixer + 3 * d * d_ff + 2 * d) + d


def fla_matched(kind: str, cfg: ESSHConfig, tier=None, align: int | None = None) -> dict:
    """FFN width of the fla peer matched to the ESSH tier (Table 54 rule)."""
    t = resolve_tier(cfg, tier)
    d_ff, params, gap = match_ffn_width(t.params, lambda f: _fla_params(kind, cfg, f), align or cfg.ffn_align)
    return {"target_params": t.params, "params": params, "gap": gap, "d_ff": d_ff}


def build_fla(kind: str, cfg: ESSHConfig, d_ff: int, device: torch.device, dtype: torch.dtype) -> FlaFFNModel:
    with torch.device(device):
        model = FlaFFNModel(kind, cfg.vocab_size, cfg.d_model, cfg.n_layers, d_ff, cfg.norm_eps)
    for ffn in model.ffns:
        ffn.reset_parameters()
    return model.to(dtype).eval()


class FlaDecoder:
    """Decode step of a ``FlaFFNModel`` with fla's own cache (native state precision).

    fla's cache replaces state tensors on every update; for a CUDA graph every new state is copied back
    into the tensor the step read from ("pinning"), so replays advance one fixed set of buffers.
    """

    def __init__(self, model: FlaFFNModel, batch: int, graph: bool, prompt: int = 16,
                 prompt_ids: torch.Tensor | None = None) -> None:
        """Prefill ``prompt_ids`` [batch, T] (default: ``prompt`` random tokens) into fla's cache; with
        ``graph`` capture one step (the warm-up steps' state changes are undone, so the next ``step``
        continues from the prompt)."""
        try:   # fla >= 0.5 keeps its cache on transformers' cache layers here; 0.6.0 has no fla.models.utils
            from fla.models.cache_utils import Cache
        except ImportError:
            from fla.models.utils import Cache

        self.model, self.cache = model, Cache()
        dev = model.embed.weight.device
        if prompt_ids is None:
            prompt_ids = torch.randint(0, model.vocab_size, (batch, prompt), device=dev)
        if prompt_ids.shape[0] != batch:
            raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows for a decoder of batch {batch}")
        with torch.no_grad():
            model(prompt_ids, cache=self.cache)
        self._pinned = [dict(layer) for layer in self.cache]
        self._graph = None
        if graph:
            saved = [(t, t.clone()) for t in self._pinned_tensors()]
            self._graph = GraphedStep(self._step, batch, dev)
            for t, copy in saved:
                t.copy_(copy)

    def _pinned_tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self._pinned:
            for v in layer.values():
                out += [t for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
        return out

    def _repin(self) -> None:
        for layer, old in zip(self.cache, self._pinned):
            for key, ref in old.items():
                new = layer.get(key)
                if isinstance(ref, torch.Tensor) and new is not ref:
                    ref.copy_(new)
                    layer[key] = ref
                elif isinstance(ref, (tuple, list)) and new is not ref:
                    for r, n in zip(ref, new):
                        if isinstance(r, torch.Tensor) and n is not r:
                            r.copy_(n)
                    layer[key] = ref

    @torch.no_grad()
    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, None], cache=self.cache)[:, 0]
        self._repin()
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._graph(tokens) if self._graph is not None else self._step(tokens)

    def reset(self) -> None:
        """Recurrent state never runs out of room."""

    def state_bytes(self) -> dict[str, int]:
        n = sum(t.numel() * t.element_size() for t in self._pinned_tensors())
        return {"recurrent": n, "kv": 0, "total": n}
