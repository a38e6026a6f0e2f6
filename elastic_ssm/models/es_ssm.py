"""ES-SSM model: byte-level LM or sequence classifier over ES-SSM blocks (ES-SSM paper Sec. 4, Alg. 1).

Embedding, ``n_layers`` pre-norm ``ESSSMBlock``s, a final LayerNorm, then the LM head (tied, or ``lm_head``
[V, d]) or, for ``task='classify'``, a mean pool over valid positions and ``head`` [C, d]. ``tier=K`` evaluates
budget K (Eq. 4); the standalone export (``slice_rules``) is bitwise equal on CPU in float32 (Appendix B.6).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ESSSMConfig, TierLike
from ..elastic import tiers as tiers_mod
from ..elastic.slicing import SliceRule
from ..layers.es_ssm import ESSSMBlock, on_meta_device
from .base import ElasticModel, empty_input_message
from .es_ssm_cache import ESSSMCache, cache_options
from .generation import GenerationMixin, check_attention_mask

__all__ = ["ESSSM"]

#: State-dict names of the channel-indexed tensors (Sec. 4.1 "direct prefix truncation"): rows of these ...
CHANNEL_TENSORS = r"blocks\.\d+\.mixer\.(?:gate_out\.weight|gate_out\.bias|filters)"
#: ... and column blocks of the channel projections (M_k = columns k d .. (k + 1) d of ``proj.weight``).
CHANNEL_COLUMNS = r"blocks\.\d+\.mixer\.proj\.weight"


class ESSSM(GenerationMixin, ElasticModel):
    """Elastic spectral SSM (ES-SSM paper): one model, a standalone export per runtime budget K."""

    arch = "es_ssm"
    keep_fp32 = r".*filters"
    config_class = ESSSMConfig

    def __init__(self, config: ESSSMConfig) -> None:
        super().__init__(config)
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)  # [V, d]
        self.blocks = nn.ModuleList(ESSSMBlock(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)
        self.lm_head: nn.Linear | None = None
        self.head: nn.Linear | None = None
        if c.task == "lm":
            if not c.tie_embeddings:
                self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)  # [V, d]
        else:
            self.head = nn.Linear(c.d_model, c.num_classes)  # [C, d], [C]
        if not on_meta_device():
            self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for embeddings and projections, zero biases, b_g2 = gate_bias_init,
        LayerNorms (1, 0); the Hankel filters are not touched. A no-op on the meta device."""
        if self.is_meta():
            return
        std = self.config.init_std
        nn.init.normal_(self.embed.weight, std=std)
        for block in self.blocks:
            block.reset_parameters()
        self.norm.reset_parameters()
        for lin in (self.lm_head, self.head):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    @classmethod
    def slice_rules(cls, config: ESSSMConfig, tier: TierLike) -> list[SliceRule]:
        """Keep the first K channels of every channel-indexed tensor of every block (Sec. 4.1, App. B.6)."""
        K = tiers_mod.resolve_tier(config, tier).K
        return [SliceRule(CHANNEL_TENSORS, K), SliceRule(CHANNEL_COLUMNS, K * config.d_model, dim=1)]

    def _check_ids(self, input_ids: Any) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids [B, T], got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}; for a single sequence "
                             "pass input_ids[None]")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor of token ids (torch.long), got {input_ids.dtype}")
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise ValueError(empty_input_message(input_ids.shape))
        L = self.config.seq_len
        if T > L:
            raise ValueError(f"sequence length T={T} exceeds the filter length L={L} this model was built for; build "
                             f"with seq_len >= T or truncate the input to {L} tokens")
        if not torch.compiler.is_compiling():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            V = self.config.vocab_size
            if lo < 0 or hi >= V:
                bad = hi if hi >= V else lo
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {V}); check the tokenizer or build the "
                                 f"model with vocab_size > {max(hi, V - 1)}")
        return input_ids

    def forward(self, input_ids: torch.Tensor, tier: TierLike = None, attention_mask: torch.Tensor | None = None,
                cache: ESSSMCache | None = None) -> torch.Tensor:
        """input_ids [B, T] (T <= cfg.seq_len) at ``tier`` (None = full budget; an int K, "K8" or a Tier) ->
        [B, T, V] next-token logits (``task='lm'``) or [B, C] class logits (``task='classify'``). Padded
        positions (``attention_mask`` [B, T], 0) never enter a convolution nor the mean pool; an empty ``cache``
        of the same budget is prefilled for ``step`` (the mask then uses left padding)."""
        K = self.resolve_tier(tier).K
        ids = self._check_ids(input_ids)
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask is not None and not torch.compiler.is_compiling():
            check_attention_mask(attention_mask, left_padding=cache is not None)   # a cache prefill: left padding
        valid = None if attention_mask is None else attention_mask.to(torch.bool)  # [B, T]
        if cache is not None:
            cache.check_prefill(K)
            if cache.batch != ids.shape[0]:
                raise ValueError(f"this cache holds batch={cache.batch} sequences, input_ids has"
                                 f" {ids.shape[0]}; allocate_cache({ids.shape[0]}, ...)")
        x = self.embed(ids)  # [B, T, d]
        for i, block in enumerate(self.blocks):
            x = block(x, K, valid, None if cache is None else cache.layers[i])  # [B, T, d]; a state now at time T
        x = self.norm(x)
        if self.config.task == "lm":
            return self.logits_from_hidden(x)  # [B, T, V]
        if attention_mask is None:
            pooled = x.mean(dim=1)  # [B, d]
        else:
            m = attention_mask.to(x.dtype).unsqueeze(-1)  # [B, T, 1]
            pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)  # [B, d]
        return self.head(pooled)  # [B, C]

    def allocate_cache(self, batch: int, tier: TierLike = None, **kw: Any) -> ESSSMCache:
        """Empty decode cache for ``batch`` sequences at budget ``tier``; keywords ``decode`` ('exact' ring buffer,
        default | 'modal'), ``n_modes`` (default 8), ``state_dtype`` (float32; float64 for a float64 model)."""
        return ESSSMCache.allocate(self, batch, tier, **kw)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: ESSSMCache) -> torch.Tensor:
        """Decode one token per sequence: tokens [B] -> logits [B, V] (Eq. 4 per token); the cache advances by one."""
        if tokens.dim() != 1 or tokens.shape[0] != cache.batch:
            raise ValueError(f"step takes one token per sequence, tokens [B={cache.batch}], got {tuple(tokens.shape)}")
        V = self.config.vocab_size
        if not torch.compiler.is_compiling() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
            raise ValueError(f"token ids must lie in [0, {V}); got [{int(tokens.min())}, {int(tokens.max())}]")
        x = self.embed(tokens)  # [B, d]
        for i, block in enumerate(self.blocks):
            x = block.step(x, cache.layers[i], cache.tier)  # [B, d]; each block's state advances by one
        return self.logits_from_hidden(self.norm(x))  # [B, V]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, tier: TierLike = None, *args: Any,
                 decode: str = "exact", n_modes: int = 8, **kw: Any) -> torch.Tensor:
        """``GenerationMixin.generate`` (same arguments, left padding, sampling) at the integer budget
        ``tier``; ``decode='modal'`` with ``n_modes`` selects the constant-memory modal decoder."""
        with cache_options(decode=decode, n_modes=n_modes):
            return super().generate(input_ids, max_new_tokens, tier, *args, **kw)
