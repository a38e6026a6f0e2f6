"""Transformer++ baseline (ESSH paper E.6): RMSNorm, RoPE, SwiGLU, full causal attention, tied embedding.

Every block is pre-norm: x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)). Attention has no biases
(q, k, v, o: 4 d^2), heads of ``head_dim``; training and prefill use PyTorch SDPA with ``is_causal``
(flash attention on CUDA). Decoding uses a *static* KV cache ``[N, B, H, L_max, hd]`` written at the
device-side position of each row and read through a length-``L_max`` mask, so a whole decode step has
fixed shapes, no host synchronisation, and can be captured in one CUDA graph.

Parameter count (the counting rules of ESSH Table 4 / Table 54): ``V d`` (tied, once)
``+ N (4 d^2 + 3 d d_ff + 2 d) + d``. The systems comparison (Table 54) fixes depth, width and
vocabulary to the ESSH model's and matches ``d_ff`` (``bench/peers.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ConfigBase, ConfigError, opt
from ...layers.attention import apply_rope, rope_cos_sin
from ...layers.ffn import SwiGLU
from ...layers.norm import RMSNorm

__all__ = ["TransformerConfig", "TransformerPP", "KVCache"]


@dataclass(kw_only=True)
class TransformerConfig(ConfigBase):
    """Transformer++ shape (ESSH paper E.6, Table 54)."""

    vocab_size: int = opt(50304, "vocabulary size V (tied embedding)")
    d_model: int = opt(896, "residual width d")
    n_layers: int = opt(22, "number of attention + SwiGLU blocks")
    d_ff: int = opt(4224, "SwiGLU width")
    head_dim: int = opt(64, "attention head dimension (heads = d / head_dim)")
    rope_base: float = opt(10000.0, "RoPE base frequency")
    norm_eps: float = opt(1e-6, "RMSNorm epsilon")
    tie_embeddings: bool = opt(True, "tie the LM head to the token embedding")
    init_std: float = opt(0.02, "std of the normal initialisation")

    def validate(self) -> None:
        for n in ("vocab_size", "d_model", "n_layers", "d_ff", "head_dim"):
            if getattr(self, n) <= 0:
                raise ConfigError(f"TransformerConfig.{n} must be > 0, got {getattr(self, n)}")
        if self.d_model % self.head_dim or self.head_dim % 2:
            raise ConfigError(f"TransformerConfig: d_model={self.d_model} must be a multiple of an even "
                              f"head_dim={self.head_dim}")

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def num_parameters(self) -> int:
        d, N = self.d_model, self.n_layers
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + N * (4 * d * d + 3 * d * self.d_ff + 2 * d) + d

    def flops_per_token(self, context: int = 2048) -> dict[str, int]:
        """Per-token FLOPs (2 per multiply-accumulate), the convention of ``elastic.tiers.flops_per_token``:
        projections 2 N 4 d^2, attention scores/values 2 N 2 d context, SwiGLU 2 N 3 d d_ff, head 2 d V."""
        d, N = self.d_model, self.n_layers
        out = {"projection": 2 * N * 4 * d * d, "attention": 2 * N * 2 * d * context,
               "ffn": 2 * N * 3 * d * self.d_ff, "head": 2 * d * self.vocab_size}
        out["total"] = sum(out.values())
        return out

    def kv_bytes(self, context: int, batch: int = 1, dtype_bytes: int = 2) -> int:
        """Persistent KV bytes: K and V of every layer for ``context`` tokens."""
        return batch * self.n_layers * 2 * context * self.d_model * dtype_bytes


@dataclass
class KVCache:
    """Static cache: keys/values [N, B, H, L_max, hd]; ``positions`` [B] next position (device)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    max_len: int

    def nbytes(self) -> dict[str, int]:
        kv = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return {"recurrent": 0, "kv": kv, "total": kv}


class _Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, out_std = cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.norm1 = RMSNorm(d, cfg.norm_eps)
        self.qkv = nn.Parameter(torch.empty(3 * d, d))
        self.out = nn.Parameter(torch.empty(d, d))
        self.norm2 = RMSNorm(d, cfg.norm_eps)
        self.ffn = SwiGLU(d, cfg.d_ff, init_std=cfg.init_std, out_std=out_std)
        if self.qkv.device.type != "meta":
            nn.init.normal_(self.qkv, std=cfg.init_std)
            nn.init.normal_(self.out, std=out_std)


class TransformerPP(nn.Module):
    """Transformer++ language model: ``forward(ids [B,T]) -> logits [B,T,V]``; ``step`` for decoding."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = (None if config.tie_embeddings
                        else nn.Linear(config.d_model, config.vocab_size, bias=False))
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight, std=config.init_std)

    def num_parameters(self) -> int:
        return self.config.num_parameters()

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm_f(h), self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def _qkv(self, blk: _Block, x: torch.Tensor, positions: torch.Tensor):
        """x [B,T,D], positions [B,T] -> q, k, v [B,H,T,hd] with RoPE on q and k."""
        B, T, _ = x.shape
        c = self.config
        q, k, v = F.linear(blk.norm1(x), blk.qkv).view(B, T, 3, c.n_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_base, q.dtype)
        cos, sin = cos[:, None], sin[:, None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Causal logits [B,T,V]. With ``cache`` (empty, positions 0) the K/V of all T tokens are stored."""
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x, pos)
            if cache is not None:
                if T > cache.max_len:
                    raise ValueError(f"prompt of {T} tokens exceeds the cache length {cache.max_len}")
                cache.keys[i, :, :, :T] = k.to(cache.keys.dtype)
                cache.values[i, :, :, :T] = v.to(cache.values.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), blk.out)
            x = x + blk.ffn(blk.norm2(x))
        if cache is not None:
            cache.positions.fill_(T)
        return self._head(x)

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | None = None) -> KVCache:
        c = self.config
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        shape = (c.n_layers, batch, c.n_heads, max_len, c.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=dtype, device=device)
        return KVCache(zeros(), zeros(),
                       torch.zeros(batch, dtype=torch.long, device=device), max_len)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B] -> logits [B,V]. Writes K/V at ``cache.positions`` and attends slots <= position.
        Shapes are static and nothing synchronises with the host (CUDA-graph capturable)."""
        B = tokens.shape[0]
        pos = cache.positions
        rows = torch.arange(B, device=tokens.device)
        allowed = torch.arange(cache.max_len, device=tokens.device)[None] <= pos[:, None]   # [B, L]
        x = self.embed(tokens)[:, None]                                   # [B,1,D]
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x, pos[:, None])                     # [B,H,1,hd]
            kc, vc = cache.keys[i], cache.values[i]                       # [B,H,L,hd]
            kc[rows, :, pos] = k[:, :, 0].to(kc.dtype)
            vc[rows, :, pos] = v[:, :, 0].to(vc.dtype)
            o = F.scaled_dot_product_attention(q.to(kc.dtype), kc, vc, attn_mask=allowed[:, None, None])
            x = x + F.linear(o.to(x.dtype).transpose(1, 2).reshape(B, 1, -1), blk.out)
            x = x + blk.ffn(blk.norm2(x))
        pos.add_(1)
        return self._head(x)[:, 0]
