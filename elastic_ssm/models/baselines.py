"""Transformer++ and MatFormer baselines (ESSH paper E.6, Tables 8, 9, 39, 54): RMSNorm, RoPE, SwiGLU, full
causal attention, tied embedding; trained through ``train()`` like ESSH.

Attention has no biases (``qkv`` [3D, D], ``out`` [D, D]); decoding uses a static KV cache [N, B, H, L_max, hd].
Parameters (Table 4 / 54 rules): ``V d + N (4 d^2 + 3 d n_ff + 2 d) + d``. The SwiGLU is ESSH's elastic layer, so
a tier ``(K = 0, n_ff)`` keeps its unit prefix; ``MatFormer`` is this model under ``MatFormerConfig``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MatFormerConfig, TierLike, TransformerConfig
from ..elastic.slicing import SliceRule, empty_linear, linear
from ..elastic.tiers import Tier
from ..layers.attention import rope_qkv, window_mask
from ..layers.ffn import RMSNorm, SwiGLU
from .base import ElasticModel
from .generation import check_token_inputs, token_positions

__all__ = ["TransformerConfig", "TransformerPP", "MatFormerConfig", "MatFormer", "KVCache"]

_FFN_IN = r"blocks\.\d+\.ffn\.w_in\.weight"      # [2F, D]: 2 n_ff rows
_FFN_OUT = r"blocks\.\d+\.ffn\.w_out\.weight"    # [D, F]: n_ff columns


@dataclass
class KVCache:
    """Static cache: keys/values [N, B, H, L_max, hd]; ``positions`` [B] the next slot (device); ``valid``
    [B, L_max] the slots holding a real token (left padding is not attended) and ``seen`` [B] a row's real tokens so
    far, the RoPE position of its next token."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    max_len: int
    valid: torch.Tensor
    seen: torch.Tensor

    def nbytes(self) -> dict[str, int]:
        kv = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return {"recurrent": 0, "kv": kv, "total": kv}


class _Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, out_std = cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.norm1 = RMSNorm(d, cfg.norm_eps)
        self.qkv = empty_linear(d, 3 * d)              # weight [3D, D]: q, k, v rows
        self.out = empty_linear(d, d)                  # weight [D, D]
        self.norm2 = RMSNorm(d, cfg.norm_eps)
        self.ffn = SwiGLU(d, cfg.d_ff, init_std=cfg.init_std, out_std=out_std)
        if self.qkv.weight.device.type != "meta":
            nn.init.normal_(self.qkv.weight, std=cfg.init_std)
            nn.init.normal_(self.out.weight, std=out_std)


class TransformerPP(ElasticModel):
    """Transformer++ language model: ``forward(ids [B,T], tier=None) -> logits [B,T,V]``; ``step`` decodes."""

    arch = "transformer"
    config_class = TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        # built around an uninitialised weight (no random op on the meta device; see ESSH.__init__)
        self.embed = nn.Embedding(config.vocab_size, config.d_model,
                                  _weight=torch.empty(config.vocab_size, config.d_model))
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self._build_head(config)

    @classmethod
    def slice_rules(cls, config: TransformerConfig, tier: Tier) -> list[SliceRule]:
        return [SliceRule(_FFN_IN, 2 * tier.n_ff, dim=0), SliceRule(_FFN_OUT, tier.n_ff, dim=1)]

    def ffn_layers(self) -> list[SwiGLU]:
        return [b.ffn for b in self.blocks]

    def _qkv(self, blk: _Block, x: torch.Tensor, positions: torch.Tensor):
        """x [B,T,D], positions [B,T] -> q, k, v [B,H,T,hd] of the block's pre-normed x, RoPE on q and k."""
        c = self.config
        return rope_qkv(blk.qkv, blk.norm1(x), positions, c.n_heads, c.head_dim, c.rope_base)

    def hidden_states(self, input_ids: torch.Tensor, tier: TierLike = None, attention_mask: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """Final-normed hidden states [B,T,D] at ``tier`` (its ``n_ff``). ``attention_mask`` [B,T] marks real
        tokens (left padding: positions count real tokens; a padding query attends itself only). With
        ``cache`` (empty, positions 0) the K/V of all T tokens are stored."""
        check_token_inputs(input_ids, self.config.vocab_size, attention_mask, left_padding=cache is not None)
        B, T = input_ids.shape
        n_ff = self.resolve_tier(tier).n_ff
        valid = None if attention_mask is None else attention_mask.bool()          # [B, T]
        pos = token_positions(valid, B, T, input_ids.device)
        idx = torch.arange(T, device=input_ids.device)
        mask = None if valid is None else window_mask(idx, idx, T, valid)          # [B, 1, T, T]: causal, real keys
        x = self.embed(input_ids)
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x, pos)
            if cache is not None:
                if T > cache.max_len:
                    raise ValueError(f"prompt of {T} tokens exceeds the cache length {cache.max_len}")
                cache.keys[i, :, :, :T] = k.to(cache.keys.dtype)
                cache.values[i, :, :, :T] = v.to(cache.values.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask)
            x = x + linear(blk.out, o.transpose(1, 2).reshape(B, T, -1))
            x = x + blk.ffn(blk.norm2(x), n_ff)
        if cache is not None:
            cache.positions.fill_(T)
            cache.valid.zero_()
            cache.valid[:, :T] = True if valid is None else valid
            cache.seen.copy_(cache.valid.sum(1))
        return self.norm_f(x)

    def forward(self, input_ids: torch.Tensor, tier: TierLike = None, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Causal logits [B,T,V] of the model at ``tier`` (None: all FFN units)."""
        return self.logits_from_hidden(self.hidden_states(input_ids, tier, attention_mask, cache))

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | None = None) -> KVCache:
        c = self.config
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        shape = (c.n_layers, batch, c.n_heads, max_len, c.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=dtype, device=device)
        return KVCache(zeros(), zeros(), torch.zeros(batch, dtype=torch.long, device=device), max_len,
                       torch.zeros(batch, max_len, dtype=torch.bool, device=device),
                       torch.zeros(batch, dtype=torch.long, device=device))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B] -> logits [B,V]. Writes K/V at slot ``cache.positions`` and attends the real slots up to it
        (a left-padded prompt's padding is never attended), RoPE at the row's real position ``cache.seen``.
        Shapes are static and nothing synchronises with the host (CUDA-graph capturable)."""
        B = tokens.shape[0]
        pos = cache.positions
        rows = torch.arange(B, device=tokens.device)
        cache.valid[rows, pos] = True
        allowed, rope = cache.valid, cache.seen                           # [B, L], [B]
        x = self.embed(tokens)[:, None]                                   # [B,1,D]
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x, rope[:, None])                    # [B,H,1,hd]
            kc, vc = cache.keys[i], cache.values[i]                       # [B,H,L,hd]
            kc[rows, :, pos] = k[:, :, 0].to(kc.dtype)
            vc[rows, :, pos] = v[:, :, 0].to(vc.dtype)
            o = F.scaled_dot_product_attention(q.to(kc.dtype), kc, vc, attn_mask=allowed[:, None, None])
            x = x + linear(blk.out, o.to(x.dtype).transpose(1, 2).reshape(B, 1, -1))
            x = x + blk.ffn(blk.norm2(x))
        pos.add_(1)
        cache.seen.add_(1)
        return self.logits_from_hidden(self.norm_f(x))[:, 0]


class MatFormer(TransformerPP):
    """MatFormer (ESSH N.1, Table 9): Transformer++ with nested FFN widths, ten deployment tiers; trained by
    the ``nested_ffn`` recipe (one of ``config.granularities`` per micro-batch); tiers export like ESSH's."""

    arch = "matformer"
    config_class = MatFormerConfig

