"""The peers of the systems comparison at the preset shapes, random weights (ESSH P.4): our Transformer++ and,
with fla, Gated DeltaNet and Mamba-2 between SwiGLU blocks (E.6; ``benchmarks/fla_peers.py`` of the research
harness, loaded by ``fla_peers``), their FFN width matched by Table 54's rule."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ..config import ConfigError, ESSHConfig
from ..elastic.tiers import num_parameters, resolve_tier
from ..models import build_model
from ..models.baselines import TransformerConfig

__all__ = ["PeerUnavailable", "fla_peers", "match_ffn_width", "transformer_matched",
           "peer_forward", "random_model", "cast_matrices"]

#: Weight matrices that run in the low-precision dtype; modal tables, gate biases, blend and norm
#: vectors stay float32 (ESSH deployment: bf16 weights, fp32 recurrence).
_MATRIX = re.compile(r"(embed\.weight|lm_head\.weight|.*\.(in_proj|out_proj|qkv|out|w_in|w_out)(\.weight)?)$")


def match_ffn_width(target: int, params_at: callable, align: int) -> tuple[int, int, float]:
    """FFN width (multiple of ``align``, >= align) whose parameter count is closest to ``target``.

    ``params_at(d_ff)`` must be affine in ``d_ff``. Returns ``(d_ff, params, gap)`` with
    ``gap = params / target - 1``."""
    p0, p1 = params_at(align), params_at(2 * align)
    slope = (p1 - p0) / align
    exact = align + (target - p0) / slope
    cands = {max(align, align * math.floor(exact / align)), max(align, align * math.ceil(exact / align))}
    best = min(cands, key=lambda f: (abs(params_at(f) - target), f))
    p = params_at(best)
    return best, p, p / target - 1


def transformer_matched(cfg: ESSHConfig) -> tuple[TransformerConfig, dict]:
    """Transformer++ with the ESSH depth/width/vocabulary and a SwiGLU width matched to the full model (Table 54)."""
    t = resolve_tier(cfg, None)
    kept = ("vocab_size", "d_model", "n_layers", "head_dim", "rope_base", "norm_eps", "tie_embeddings", "init_std")
    base = TransformerConfig(d_ff=cfg.ffn_align, **{k: getattr(cfg, k) for k in kept})
    d_ff, params, gap = match_ffn_width(t.params, lambda f: num_parameters(base.replace(d_ff=f)), cfg.ffn_align)
    return base.replace(d_ff=d_ff), {"target_params": t.params, "params": params, "gap": gap, "d_ff": d_ff}


@torch.no_grad()
def cast_matrices(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the weight matrices of an ESSH / Transformer++ model to ``dtype`` (in place)."""
    for name, p in model.named_parameters():
        if _MATRIX.fullmatch(name):
            p.data = p.data.to(dtype)
    return model


def random_model(cfg, device: torch.device, dtype: torch.dtype | None = None):
    """Random-weight model of ``cfg`` (ESSH, Transformer++: ``models.build_model``) created directly on ``device``;
    matrices cast to ``dtype``."""
    with torch.device(device):
        model = build_model(cfg)
    return (cast_matrices(model, dtype) if dtype is not None else model).eval()


def peer_forward(model: nn.Module, peer: str, compile: bool, mode: str = "default"):
    """``(forward, compiled)`` for timing a peer: with ``compile`` our Transformer++ is ``torch.compile``d
    like ESSH (``BenchConfig.compile``), so compiled ESSH is compared with a compiled Transformer++; fla
    peers stay eager (their kernels sit behind ``torch.compiler.disable`` and fla tunes them itself)."""
    if compile and peer == "transformer":
        kw = {} if mode == "default" else {"mode": mode}
        return torch.compile(model, dynamic=False, **kw), True
    return model, False


class PeerUnavailable(RuntimeError):
    """A peer's optional library is missing: reported in the results, not treated as a failure."""


def fla_peers():
    """``benchmarks.fla_peers`` (the Gated DeltaNet and Mamba-2 peers), found as the harness's suite kinds are
    (``harness.harness_module``); outside a clone a ``PeerUnavailable`` saying where it lives."""
    from .harness import harness_module

    try:
        return harness_module("the fla peer module", "benchmarks.fla_peers")
    except ConfigError as e:
        raise PeerUnavailable(str(e)) from None
