"""ESSH: the elastic selective spectral hybrid language model (ESSH paper Sec. 4, Appendix E.2).

Pre-norm blocks by ``config.layout`` ('S' spectral mixer, 'A' sliding-window attention): x += Mixer(RMSNorm(x));
x += SwiGLU(RMSNorm(x)); a final RMSNorm and the tied embedding give the logits. A tier keeps the first K_T
channels and n_ff,T units (``elastic/slicing.py``); attention, embeddings and norms are shared (Sec. 4.2)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import ESSHConfig
from ..elastic.slicing import RowTiers, SliceRule
from ..elastic.tiers import Tier
from ..layers.attention import SlidingWindowAttention
from ..layers.ffn import RMSNorm, SwiGLU
from ..layers.spectral_mixer import SpectralMixer
from .base import ElasticModel
from .cache import ESSHCache, check_cache
from .compile import compile_trunk, scan_backend, trunk_for
from .fast_decode import FusedSession, decoder_pool, use_fast_decoding
from .generation import GenerationMixin, ReferenceSession, check_step_tokens, check_token_inputs, token_positions

__all__ = ["ESSH", "ESSHBlock", "randomize_selective"]

#: Channel-indexed tensors of the spectral mixers, cut to the first K_T channels: rows (dim 0) ...
_MIXER_TENSORS = r"blocks\.\d+\.mixer\.(gate_bias|rho_raw|theta|kc|ks|a|beta)"
_MIXER_IN = r"blocks\.\d+\.mixer\.in_proj\.weight"      # [K (P + 3M), D]: K_T (P + 3M) rows
_MIXER_OUT = r"blocks\.\d+\.mixer\.out_proj\.weight"    # [D, K P]: K_T P columns
_FFN_IN = r"blocks\.\d+\.ffn\.w_in\.weight"             # [2F, D]: 2 n_ff rows
_FFN_OUT = r"blocks\.\d+\.ffn\.w_out\.weight"           # [D, F]: n_ff columns


class ESSHBlock(nn.Module):
    def __init__(self, cfg: ESSHConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        if kind == "S":
            self.mixer: nn.Module = SpectralMixer(
                cfg.d_model, cfg.n_channels, cfg.n_modes, cfg.value_width, filter_length=cfg.filter_length,
                pole_clip=cfg.pole_clip, clock_bias_init=cfg.clock_bias_init, zero_lag_init=cfg.zero_lag_init,
                blend_eps=cfg.blend_eps, init_std=cfg.init_std, out_std=out_std)
        else:
            self.mixer = SlidingWindowAttention(cfg.d_model, cfg.head_dim, cfg.window, cfg.rope_base,
                                                init_std=cfg.init_std, out_std=out_std)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, init_std=cfg.init_std, out_std=out_std)

    def forward(self, x, tier: Tier, positions, valid, state=None, backend="auto"):
        """x [B,T,D] -> [B,T,D]; ``state`` (this layer's slice of a decode cache) is filled by the mixer."""
        x = x + self.mixer.mix(self.norm1(x), tier, positions, valid, state, backend)
        return x + self.ffn(self.norm2(x), tier.n_ff, getattr(tier, "unit_mask", None))

    def step(self, x, state, tier: Tier):
        """One token: x [B,D] -> [B,D]; the mixer's ``step`` advances ``state`` (its cache slice)."""
        x = x + self.mixer.step(self.norm1(x), state, tier)
        return x + self.ffn(self.norm2(x), tier.n_ff)


class ESSH(GenerationMixin, ElasticModel):
    """The shared elastic model (or, with a tier's standalone config, an exported compact model)."""

    arch = "essh"
    config_class = ESSHConfig
    keep_fp32 = _MIXER_TENSORS
    scans_with_fla = True

    def __init__(self, config: ESSHConfig) -> None:
        super().__init__(config)
        # Built around an uninitialised weight: nn.Embedding's own init would run a random op, and the first
        # random op on the meta device (from_pretrained builds there) costs ~4 s of one-time imports.
        self.embed = nn.Embedding(config.vocab_size, config.d_model,
                                  _weight=torch.empty(config.vocab_size, config.d_model))
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight)   # nn.Embedding's own init, at the same point of the RNG stream
        self.blocks = nn.ModuleList(ESSHBlock(config, kind) for kind in config.layout)
        self._build_head(config)

    @classmethod
    def slice_rules(cls, config: ESSHConfig, tier: Tier) -> list[SliceRule]:
        K, P, M = tier.K, config.value_width, config.n_modes
        return [SliceRule(_MIXER_TENSORS, K), SliceRule(_MIXER_IN, K * (P + 3 * M)), SliceRule(_MIXER_OUT, K * P, 1),
                SliceRule(_FFN_IN, 2 * tier.n_ff), SliceRule(_FFN_OUT, tier.n_ff, 1)]

    def ffn_layers(self) -> list[SwiGLU]:
        return [b.ffn for b in self.blocks]

    def _run(self, input_ids: torch.Tensor, tier: Any, attention_mask: torch.Tensor | None, cache: ESSHCache | None,
             backend: str, logits: bool) -> torch.Tensor:
        """Eager checks (tier, padding mask, positions [B, T], scan backend), then the (possibly compiled) trunk."""
        # a cache prefill continues from the end of every row: its padding must come first
        check_token_inputs(input_ids, self.config.vocab_size, attention_mask, left_padding=cache is not None)
        B, T = input_ids.shape
        if isinstance(tier, (list, tuple)):          # one tier per row, computed at the widest (or the cache's)
            if len(tier) != B:
                raise ValueError(f"tier=[...] names one tier per row: {len(tier)} tiers for {B} rows")
            t = self.row_tiers(tier, None if cache is None else cache.tier)
        else:
            t = tier if isinstance(tier, RowTiers) else self.resolve_tier(tier)
        if cache is not None:
            check_cache(cache, ESSHCache, B, t.widest if isinstance(t, RowTiers) else t)
        valid = None if attention_mask is None else attention_mask.bool()
        positions = token_positions(valid, B, T, input_ids.device)
        if cache is not None and bool(cache.positions.any()):
            raise ValueError("forward(cache=...) prefills an empty cache; continue a cached sequence with "
                             "step() (or allocate a new cache and prefill the whole prefix)")
        backend = scan_backend(self, backend, input_ids.device)  # eager: the compiled trunk gets a constant
        out = trunk_for(self, cache)(self, input_ids, t, positions, valid, cache, backend, logits)
        self.verified()                         # hidden states too wait for a deferred load's checksum
        if cache is not None:
            cache.positions += input_ids.shape[1] if valid is None else valid.long().sum(1)
        return out

    def _trunk(self, input_ids: torch.Tensor, t: Tier, positions: torch.Tensor, valid: torch.Tensor | None,
               cache: ESSHCache | None, backend: str, logits: bool) -> torch.Tensor:
        """Embedding, blocks and final norm (and the logits when ``logits``): what ``compile.py`` compiles."""
        x = self.embed(input_ids)
        states = [None] * len(self.blocks) if cache is None else cache.layers
        for block, state in zip(self.blocks, states):
            x = block(x, t, positions, valid, state, backend)
        x = self.norm_f(x)
        return self.logits_from_hidden(x) if logits else x

    def row_tiers(self, tiers: list | tuple, widest: Any = None) -> RowTiers:
        """``tiers`` (one per row) as a ``RowTiers`` at ``widest`` (None: the widest of them): what ``forward`` and
        ``hidden_states`` take as ``tier=[...]``, each row equal to its own tier's forward up to rounding."""
        rows = [self.resolve_tier(t) for t in tiers]
        w = max(rows, key=lambda t: t.index) if widest is None else self.resolve_tier(widest)
        emb = self.embed.weight
        dtype = torch.promote_types(emb.dtype, torch.float32)
        return RowTiers.build(w, rows, self.config.value_width, emb.device, dtype)

    def hidden_states(self, input_ids: torch.Tensor, tier: Any = None, attention_mask: torch.Tensor | None = None,
                      cache: ESSHCache | None = None, backend: str = "auto") -> torch.Tensor:
        """Final-normed hidden states [B,T,D]. ``attention_mask`` [B,T] marks real tokens (left padding); ``tier``
        may name one tier per row (``row_tiers``)."""
        return self._run(input_ids, tier, attention_mask, cache, backend, logits=False)

    def forward(self, input_ids: torch.Tensor, tier: Any = None, attention_mask: torch.Tensor | None = None,
                cache: ESSHCache | None = None, backend: str = "auto") -> torch.Tensor:
        """Logits [B,T,V] of the shared model at ``tier`` (None: full capacity)."""
        return self._run(input_ids, tier, attention_mask, cache, backend, logits=True)

    def compile_forward(self, **kw: Any) -> ESSH:
        """``torch.compile`` the model's forward and backward in place (the trunk: ``compile.compile_trunk``);
        returns ``self``. ``kw`` goes to ``torch.compile``; ``compile_forward(disable=True)`` undoes it."""
        return compile_trunk(self, **kw)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: ESSHCache) -> torch.Tensor:
        """Decode one token per sequence (the reference step): tokens [B] -> logits [B,V]; the cache advances."""
        check_cache(cache, ESSHCache)
        check_step_tokens(tokens, cache.batch, self.config.vocab_size)
        t = cache.tier
        x = self.embed(tokens)
        for block, state in zip(self.blocks, cache.layers):
            x = block.step(x, state, t)
        cache.positions += 1
        return self.logits_from_hidden(self.norm_f(x))

    def allocate_cache(self, batch: int, tier: Any = None, **kw: Any) -> ESSHCache:
        return ESSHCache.allocate(self, batch, tier, **kw)

    def _decode_session(self, batch: int, tier: Any, fast: bool | None, state_dtype, kv_dtype):
        """``generate``'s decoder: the pooled fused decoder (``models/fast_decode.py``; CUDA-graphed on
        CUDA, with a graphed prefill when the model is compiled), or the reference step."""
        if not use_fast_decoding(self, fast):
            return ReferenceSession(self, batch, tier, state_dtype, kv_dtype)
        return FusedSession(self, batch, tier, state_dtype, kv_dtype)

    def clear_decoders(self) -> None:
        """Free the pooled decoders and their CUDA graphs (``models/fast_decode.py``)."""
        decoder_pool(self).clear()


@torch.no_grad()
def randomize_selective(model: ESSH, ffn_out_std: float = 0.05, zero_lag: bool = False) -> ESSH:
    """Move a freshly initialised ESSH away from its near-identity start (gates at one, beta 0), for tests
    and shape benchmarks: random gate/clock weights (std 0.3) and biases (std 0.5), blend beta in [0, 1),
    SwiGLU down projections with std ``ffn_out_std``; with ``zero_lag`` also a ~ U[0, 1). Uses the global
    torch RNG; returns ``model``."""
    c = model.config
    P = c.value_width
    for b in model.blocks:
        if b.kind == "S":
            b.mixer.in_proj.weight.view(-1, P + 3 * c.n_modes, c.d_model)[:, P:].normal_(std=0.3)
            b.mixer.gate_bias.normal_(std=0.5)
            b.mixer.beta.uniform_(0, 1)
            if zero_lag:
                b.mixer.a.uniform_(0, 1)
        w = b.ffn.w_out.weight
        w.copy_(w.new_empty(c.d_ff, c.d_model).normal_(std=ffn_out_std).t())   # drawn unit-major
    return model
