"""ES-SSM, Transformer++ and MatFormer directories as ``transformers`` causal LMs (``ESSHForCausalLM``'s siblings),
decoding through ``StepCache``: ES-SSM's ``ESSSMCache`` (the last L-1 inputs per block) or the baselines' static
``KVCache`` [N, B, H, L_max, hd], sized to ``generate``'s ``max_length`` (a longer run is refused in one line)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import TransformerConfig
from ..models.baselines import KVCache
from .modeling import CACHE_KEY, ElasticForCausalLM, ElasticHFConfig, _NoRollbackCache

__all__ = ["ESSSMForCausalLM", "ESSSMHFConfig", "MatFormerForCausalLM", "MatFormerHFConfig", "StepCache",
           "TransformerPPForCausalLM", "TransformerPPHFConfig"]


class StepCache(_NoRollbackCache):
    """Decoding state of an ES-SSM (``ESSSMCache``) or a baseline (``KVCache``, at least ``max_length`` positions)
    for ``transformers`` generation, allocated at the prefill (``ensure``)."""

    def __init__(self, model: Any, n_layers: int, max_length: int = 0) -> None:
        super().__init__(n_layers)
        self.model, self.max_length = model, max_length
        self.inner: Any = None

    def ensure(self, batch: int, length: int) -> Any:
        """Allocate ``inner`` for ``batch`` sequences of a ``length``-token prompt unless it already fits."""
        if self.inner is None or self.batch_size != batch:
            if isinstance(self.model.config, TransformerConfig):   # MatFormerConfig subclasses it
                self.inner = self.model.allocate_cache(batch, max(self.max_length, length))
            else:
                self.inner = self.model.allocate_cache(batch)
        return self.inner

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions written (the padded prompt plus the steps taken)."""
        if not self.prefilled:
            return 0
        return int(self.inner.positions.max()) if isinstance(self.inner, KVCache) else self.inner.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.inner.max_len if isinstance(self.inner, KVCache) else -1

    @property
    def batch_size(self) -> int:
        if self.inner is None:
            return 0
        return int(self.inner.positions.shape[0]) if isinstance(self.inner, KVCache) else self.inner.batch

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.n_layers

    @torch.no_grad()
    def _apply(self, fn) -> None:
        """Replace every per-sequence tensor by ``fn(tensor)`` along its batch dimension."""
        c = self.inner
        if isinstance(c, KVCache):           # keys / values [N, B, H, L, hd]: batch is dim 1
            c.keys = fn(c.keys.movedim(1, 0)).movedim(0, 1).contiguous()
            c.values = fn(c.values.movedim(1, 0)).movedim(0, 1).contiguous()
            c.positions = fn(c.positions)
            c.valid, c.seen = fn(c.valid), fn(c.seen)
        else:
            for s in c.layers.values():
                s.buffer = fn(s.buffer)
            c.batch = int(next(iter(c.layers.values())).buffer.shape[0])

    def reset(self) -> None:
        self.inner, self.prefilled = None, False


class _StepFamily(ElasticForCausalLM):
    """What the three families share: a ``StepCache`` allocated at the prefill."""

    cache_class = StepCache

    def allocate_cache(self, batch_size: int, prompt_length: int = 0, max_length: int = 0) -> StepCache:
        cache = StepCache(self.model, self.model.config.n_layers, max_length)
        cache.ensure(batch_size, prompt_length)
        return cache

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                                      batch_size: int, max_cache_length: int, *args: Any, **kwargs: Any) -> None:
        """A ``StepCache`` as long as ``generate``'s ``max_length`` (the KV cache of a baseline is static)."""
        if model_kwargs.get(CACHE_KEY) is None and generation_config.use_cache is not False:
            model_kwargs[CACHE_KEY] = StepCache(self.model, self.model.config.n_layers, max_cache_length + 1)

    def _inner_for_prefill(self, cache: StepCache, input_ids: torch.Tensor) -> Any:
        return cache.ensure(*input_ids.shape)

    def _step(self, tokens: torch.Tensor, cache: StepCache) -> torch.Tensor:
        inner = cache.inner
        if isinstance(inner, KVCache) and int(inner.positions.max()) >= inner.max_len:
            raise ValueError(f"the key/value cache holds {inner.max_len} positions and is full; generate with a "
                             "larger max_length / max_new_tokens (it sizes the cache)")
        return self.model.step(tokens, inner)


class ESSSMHFConfig(ElasticHFConfig):
    """An ES-SSM language model's directory (model_type ``es_ssm``); ``tier`` is a budget name such as ``"K4"``."""

    model_type = "es_ssm"
    arch: str = "es_ssm"


class ESSSMForCausalLM(_StepFamily):
    """An ES-SSM behind ``transformers``: the exact decoder of ``ESSSM.generate`` (a ring of the last L-1 inputs)."""

    config_class = ESSSMHFConfig
    _no_split_modules = ["ESSSMBlock"]


class TransformerPPHFConfig(ElasticHFConfig):
    """A Transformer++ directory (model_type ``transformer_pp``)."""

    model_type = "transformer_pp"
    arch: str = "transformer"


class TransformerPPForCausalLM(_StepFamily):
    """A Transformer++ behind ``transformers``: our static KV cache, prefill with SDPA, one ``step`` per token."""

    config_class = TransformerPPHFConfig
    _no_split_modules = ["_Block"]


class MatFormerHFConfig(ElasticHFConfig):
    """A MatFormer directory (model_type ``matformer``); ``tier`` is a nested FFN width such as ``"T4"``."""

    model_type = "matformer"
    arch: str = "matformer"


class MatFormerForCausalLM(TransformerPPForCausalLM):
    """A MatFormer behind ``transformers`` (a Transformer++ with nested FFNs)."""

    config_class = MatFormerHFConfig

