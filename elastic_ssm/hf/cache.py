"""``ESSHHFCache``: our ``ESSHCache`` (mode states ``[B, K_T, M, 2, P]`` per spectral layer, a ring of ``window``
key/value slots ``[B, H, W, hd]`` per SWA layer) behind ``transformers.Cache``: length, batch size and beam edits;
a recurrent state cannot be rolled back (``crop`` refuses)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from ..config import TierLike
from ..models.cache import ESSHCache

__all__ = ["ESSHHFCache"]


class _NoRollbackCache(Cache):
    """Our caches' common part: ``n_layers`` layers, beam edits by ``_apply(fn)``, no rollback."""

    is_compileable = False
    n_layers: int
    prefilled: bool

    def __len__(self) -> int:
        return self.n_layers

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.prefilled

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.n_layers

    def _apply(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(f"this cache cannot be rolled back by {tokens_to_remove} tokens (assisted "
                                      "decoding is not supported)")

    def activate_past_recording(self) -> None:
        raise NotImplementedError("this cache cannot record past states (assisted decoding is not supported)")

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        return None

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        return None


class ESSHHFCache(_NoRollbackCache):
    """Decoding state of ``batch_size`` sequences of one ESSH at ``tier`` (None: the model as loaded) for
    ``transformers`` generation; ``state_dtype`` / ``kv_dtype`` as ``ESSHCache.allocate``."""

    def __init__(self, model: Any, batch_size: int, tier: TierLike = None, state_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[])
        self.inner = ESSHCache.allocate(model, batch_size, tier, state_dtype=state_dtype, kv_dtype=kv_dtype)
        self.n_layers = model.config.n_layers
        self.prefilled = False

    def __repr__(self) -> str:
        n = self.inner.nbytes()
        return (f"ESSHHFCache(batch={self.inner.batch}, tier={self.inner.tier.name}, seen={self.get_seq_length()}, "
                f"recurrent={n['recurrent']:,} B, kv={n['kv']:,} B)")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the longest sequence (left padding does not count)."""
        return int(self.inner.positions.max()) if self.prefilled else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1                                         # fixed-size state: no length limit

    @property
    def batch_size(self) -> int:
        return self.inner.batch

    @property
    def is_sliding(self) -> list[bool]:
        return [i not in self.inner.states for i in range(self.n_layers)]   # an SWA layer's key/value ring

    @property
    def is_linear(self) -> list[bool]:
        return [i in self.inner.states for i in range(self.n_layers)]       # a spectral layer's mode state

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``recurrent``, ``kv`` and ``total`` (equals ``elastic.tiers.state_bytes`` x batch)."""
        return self.inner.nbytes()

    def _apply(self, fn) -> None:
        self.inner.apply_(fn)

    def reset(self) -> None:
        self.inner.reset_()
        self.prefilled = False
