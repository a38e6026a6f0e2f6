"""Training objectives as token *sums*, and the ``LossModule`` that DDP wraps; the loop divides by the global
valid-token count N_tok (the N_r / N_tok weighting of Algorithm 1 line 19, D.7).

* Full micro-batch:       CE(p_full, y)                                        (Alg. 1 line 10)
* Reduced micro-batch:    CE(p_T, y) + kl_coef KL(sg[p_full] || p_T)            (Eq. 8 / Eq. 26)
* Shared refinement:      CE(p_full, y) + CE(p_T, y) + tv_coef TV(sg[p_full], p_T)  (D.8)
  with TV(p, q) = 1/2 sum_v |p(v) - q(v)|.

Reductions run in fp32 (D.6). The chunked path (D.6) computes the logits of ``chunk`` positions at a time from the
final hidden states and recomputes them in backward, so the full [B, T, V] logits never exist."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import TierLike

__all__ = ["IGNORE_INDEX", "loss_sums", "chunked_loss_sums", "LossModule", "ffn_grad_scaled"]

IGNORE_INDEX = -100


def loss_sums(logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None = None,
              coef: float = 0.0, kind: str = "kl") -> torch.Tensor:
    """``[objective, ce, aux]`` summed over valid positions (fp32): ``logits`` [..., V], ``labels`` [...] (-100
    ignored), ``teacher`` [..., V] (stop-gradient logits or None); ``aux`` is KL(p_teacher || p) (``kind='kl'``) or
    TV(p_teacher, p) (``'tv'``); ``objective = ce + coef * aux``."""
    V = logits.shape[-1]
    logp = logits.reshape(-1, V).float().log_softmax(-1)                   # [N, V]
    y = labels.reshape(-1)
    ce = F.nll_loss(logp, y, ignore_index=IGNORE_INDEX, reduction="sum")
    if teacher is None or coef == 0.0:
        return torch.stack([ce, ce, ce.new_zeros(())])
    valid = (y != IGNORE_INDEX).to(logp.dtype)                             # [N]
    tlogp = teacher.detach().reshape(-1, V).float().log_softmax(-1)        # [N, V]
    if kind == "kl":
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    elif kind == "tv":
        per = 0.5 * (tlogp.exp() - logp.exp()).abs().sum(-1)
    else:
        raise ValueError(f"kind must be 'kl' or 'tv', got {kind!r}")
    aux = (per * valid).sum()
    return torch.stack([ce + coef * aux, ce, aux])


def chunked_loss_sums(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                      labels: torch.Tensor, teacher_hidden: torch.Tensor | None = None, coef: float = 0.0,
                      kind: str = "kl", chunk: int = 4096) -> torch.Tensor:
    """``loss_sums`` from final hidden states ``hidden`` [B, T, D], ``chunk`` positions at a time under activation
    checkpointing (D.6); ``head`` maps [n, D] -> [n, V], also for ``teacher_hidden`` (without gradient)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    D = hidden.shape[-1]
    h = hidden.reshape(-1, D)                                              # [N, D]
    y = labels.reshape(-1)
    th = None if teacher_hidden is None else teacher_hidden.detach().reshape(-1, D)

    def one(hc: torch.Tensor, yc: torch.Tensor, tc: torch.Tensor | None) -> torch.Tensor:
        logits = head(hc)
        if tc is None:
            return loss_sums(logits, yc)
        with torch.no_grad():
            tlogits = head(tc)
        return loss_sums(logits, yc, tlogits, coef, kind)

    total = h.new_zeros(3, dtype=torch.float32)
    for lo in range(0, h.shape[0], chunk):
        tc = None if th is None else th[lo:lo + chunk]
        total = total + checkpoint(one, h[lo:lo + chunk], y[lo:lo + chunk], tc, use_reentrant=False)
    return total


@contextmanager
def _ffn_set(model: nn.Module, name: str, value: Any, on: bool = True) -> Iterator[None]:
    """Inside the block (when ``on``), attribute ``name`` of every FFN layer of ``model`` is ``value``."""
    layers = model.ffn_layers() if on and hasattr(model, "ffn_layers") else []
    before = [getattr(f, name) for f in layers]
    for f in layers:
        setattr(f, name, value)
    try:
        yield
    finally:
        for f, old in zip(layers, before):
            setattr(f, name, old)


def ffn_grad_scaled(model: nn.Module, scale: float | None) -> AbstractContextManager[None]:
    """Inside the block, forwards of ``model``'s FFN layers scale the gradients of their retained weights by
    ``scale`` (ESSH D.4, W_hat = a W + (1 - a) sg(W); Alg. 1 lines 16-18); recorded in the graph at forward time,
    so the backward may run after the block. None changes nothing."""
    return _ffn_set(model, "grad_scale", scale, scale is not None)


class LossModule(nn.Module):
    """An elastic model whose ``forward(input_ids, labels, tier, ...)`` returns a micro-batch's fp32 sums
    ``[objective, ce, aux, ce_full]`` (DDP wraps this). ``distill=None``: plain CE at ``tier``; ``('kl', c)``: the
    teacher is the model at full capacity under ``no_grad`` (Alg. 1 line 12; post-hoc recovery, E.7: the frozen
    ``model.__dict__["frozen_teacher"]``), the student runs at ``tier`` with ``ffn_grad_scale`` (lines 16-18);
    ``('tv', c), full_ce=True``: shared refinement, the full pass keeps its gradient and its detached prediction is
    the teacher (D.8). ``chunk`` > 0: the chunked loss (needs ``hidden_states`` / ``logits_from_hidden``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def _out(self, input_ids, tier, mask, scale, hidden: bool) -> torch.Tensor:
        kw = {"tier": tier} if mask is None else {"tier": tier, "attention_mask": mask}
        with ffn_grad_scaled(self.model, scale):
            return (self.model.hidden_states if hidden else self.model)(input_ids, **kw)

    @torch.no_grad()
    def idle_teacher(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk: int = 0) -> None:
        """A teacher pass (full capacity, no gradient) whose output is discarded and FFN statistics untouched:
        the padding of ``dist.teacher_padding`` under FSDP2."""
        with _ffn_set(self.model, "track_activations", False):
            self._out(input_ids, None, attention_mask, None, chunk > 0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, tier: TierLike = None,
                ffn_grad_scale: float | None = None, distill: tuple[str, float] | None = None,
                full_ce: bool = False, attention_mask: torch.Tensor | None = None,
                chunk: int = 0) -> torch.Tensor:
        hidden = chunk > 0
        if hidden and not hasattr(self.model, "logits_from_hidden"):
            raise ValueError(f"loss_chunk > 0 needs a model with hidden_states/logits_from_hidden; "
                             f"{type(self.model).__name__} has none: set loss_chunk=0")
        teacher = None
        frozen = self.model.__dict__.get("frozen_teacher")   # post-hoc recovery's parent (train/recover.py)
        if full_ce:
            teacher = self._out(input_ids, None, attention_mask, None, hidden)
        elif distill is not None and frozen is not None:
            if hidden:
                raise ValueError("post-hoc recovery distils from a separate parent: set loss_chunk=0")
            with torch.no_grad():
                kw = {} if attention_mask is None else {"attention_mask": attention_mask}
                teacher = frozen(input_ids, **kw)
        elif distill is not None:
            with torch.no_grad():
                teacher = self._out(input_ids, None, attention_mask, None, hidden)
        out = self._out(input_ids, tier, attention_mask, ffn_grad_scale, hidden)
        kind, coef = distill if distill is not None else ("kl", 0.0)
        sums_of = partial(chunked_loss_sums, self.model.logits_from_hidden, chunk=chunk) if hidden else loss_sums
        sums = sums_of(out, labels, teacher, coef, kind)
        if not full_ce:
            return torch.cat([sums, sums.new_zeros(1)])
        ce_full = sums_of(teacher, labels)[1]
        return torch.stack([sums[0] + ce_full, sums[1], sums[2], ce_full])
