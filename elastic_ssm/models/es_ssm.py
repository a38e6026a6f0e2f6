"""ES-SSM model: byte-level LM or sequence classifier over ES-SSM blocks (ES-SSM paper Sec. 4, Alg. 1).

Embedding, ``n_layers`` pre-norm ``ESSSMBlock``s, a final LayerNorm, then the LM head (tied, or ``lm_head``
[V, d]) or, for ``task='classify'``, a mean pool over valid positions and ``head`` [C, d]. ``tier=K`` evaluates
budget K (Eq. 4); the standalone export (``slice_rules``) is bitwise equal on CPU in float32 (Appendix B.6)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ESSSMConfig, TierLike
from ..elastic import tiers as tiers_mod
from ..elastic.slicing import SliceRule
from ..layers.es_ssm import ESSSMBlock
from .base import ElasticModel
from .cache import ESSSMCache, check_cache
from .generation import GenerationMixin, check_step_tokens, check_token_inputs

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
    #: ``generate(decode=, n_modes=)``: 'exact' (ring buffer, default) | 'modal' (the constant-memory modal
    #: decoder with ``n_modes`` modes per channel, default 8), passed to ``allocate_cache``
    cache_options = ("decode", "n_modes")

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

    def forward(self, input_ids: torch.Tensor, tier: TierLike = None, attention_mask: torch.Tensor | None = None,
                cache: ESSSMCache | None = None) -> torch.Tensor:
        """input_ids [B, T] (T <= cfg.seq_len) at ``tier`` (None = full budget; an int K, "K8" or a Tier) ->
        [B, T, V] next-token logits (``task='lm'``) or [B, C] class logits (``task='classify'``). Padded
        positions (``attention_mask`` [B, T], 0) never enter a convolution nor the mean pool; an empty ``cache``
        of the same budget is prefilled for ``step`` (the mask then uses left padding)."""
        K = self.resolve_tier(tier).K
        check_token_inputs(input_ids, self.config.vocab_size, attention_mask, left_padding=cache is not None)
        ids, L = input_ids, self.config.seq_len
        if ids.shape[1] > L:
            raise ValueError(f"sequence length T={ids.shape[1]} exceeds the filter length L={L} this model was built "
                             f"for; build with seq_len >= T or truncate the input to {L} tokens")
        valid = None if attention_mask is None else attention_mask.to(torch.bool)  # [B, T]
        if cache is not None:
            check_cache(cache, ESSSMCache, ids.shape[0])
            cache.check_prefill(K)
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
        check_cache(cache, ESSSMCache)
        check_step_tokens(tokens, cache.batch, self.config.vocab_size)
        x = self.embed(tokens)  # [B, d]
        for i, block in enumerate(self.blocks):
            x = block.step(x, cache.layers[i], cache.tier)  # [B, d]; each block's state advances by one
        return self.logits_from_hidden(self.norm(x))  # [B, V]
