"""Decode latency: one synchronous step of the whole batch after ``context`` tokens placed in the caches (random
values), median ms by CUDA events, eager or one CUDA graph of the step (ESSH E.5, Appendix R; docs/performance.md);
and the user's generation path, ``model.generate`` per tier and batch (first call, prefill, ms/token, the step).

The peers of the systems comparison at the preset shapes, random weights (ESSH P.4): our Transformer++ and,
with fla, Gated DeltaNet and Mamba-2 between SwiGLU blocks (E.6; ``benchmarks/fla_peers.py`` of the research
harness, loaded by ``fla_peers``), their FFN width matched by Table 54's rule.

Timing helpers of every benchmark: warm-up then timed calls (CUDA events on the GPU, ``perf_counter`` on
the CPU), medians, wall-clock calls, CUDA-graph replays, OOM as a result."""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..config import ConfigError, ESSHConfig
from ..elastic.tiers import num_parameters, resolve_tier, state_bytes
from ..models import build_model
from ..models.baselines import TransformerConfig
from ..models.compile import capture_graph
from ..models.fast_decode import FastDecoder, decoder_pool

__all__ = ["EsshDecoder", "TransformerDecoder", "bench_decode", "peer_model", "built_peer", "decode_suite",
           "bench_generate", "generate_suite", "PeerUnavailable", "fla_peers", "match_ffn_width",
           "transformer_matched", "peer_forward", "random_model", "cast_matrices", "sync", "time_fn", "summarize",
           "wall_ms", "oom_as_result", "GraphedStep"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> list[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times; per-call times in ms (CUDA events on CUDA,
    one event pair per call, read after one final synchronisation)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        new = lambda: torch.cuda.Event(enable_timing=True)
        ev = [(new(), new()) for _ in range(iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in ev]
    return [wall_ms(fn, device) for _ in range(iters)]


def summarize(times_ms: list[float]) -> dict[str, float]:
    """Median, min and spread (p90 - p10) of a list of times in ms."""
    q = statistics.quantiles(times_ms, n=10) if len(times_ms) >= 2 else [times_ms[0]] * 9
    return {"ms": statistics.median(times_ms), "ms_min": min(times_ms), "ms_spread": q[-1] - q[0], "n": len(times_ms)}


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock ms of one call of ``fn``, the device synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3


@contextlib.contextmanager
def oom_as_result(row: dict, device: torch.device, peak: bool = False) -> Iterator[None]:
    """One benchmark entry: on CUDA the allocator cache is emptied before and after the body (and with ``peak`` the
    peak counter reset, then ``row["peak_gb"]`` set in decimal GB); out-of-memory becomes ``row["error"] = "OOM"``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        if peak:
            torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
        if cuda and peak:
            row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    finally:
        if cuda:
            torch.cuda.empty_cache()


class GraphedStep:
    """CUDA graph of ``step(tokens [B]) -> logits`` for any step function with static buffers
    (``models.compile.capture_graph``)."""

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], batch: int, device: torch.device,
                 warmup: int = 2) -> None:
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.graph, self.out = capture_graph(lambda: step(self.tokens), warmup)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.graph.replay()
        return self.out


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
    (``bench.harness_module``); outside a clone a ``PeerUnavailable`` saying where it lives."""
    from . import harness_module

    try:
        return harness_module("the fla peer module", "benchmarks.fla_peers")
    except ConfigError as e:
        raise PeerUnavailable(str(e)) from None


@torch.no_grad()
def _fill_random(t: torch.Tensor, std: float = 0.1) -> None:
    if t.is_floating_point():
        t.normal_(std=std)


class EsshDecoder:
    """ESSH at a tier: ``FastDecoder`` (``fused=True``) or the reference ``model.step`` (unfused control)."""

    def __init__(self, model, tier, batch: int, context: int, graph: bool, fused: bool = True,
                 backend: str = "auto", out_layout: str = "auto", pdl: bool | str = "auto") -> None:
        cache = model.allocate_cache(batch, tier, state_dtype=torch.float32, kv_dtype=model.embed.weight.dtype)
        W = model.config.window
        rings = cache.rings.values()
        for t in (*cache.states.values(), *(r.keys for r in rings), *(r.values for r in rings)):
            _fill_random(t)
        last = torch.arange(max(0, context - W), context, device=cache.positions.device)
        for ring in rings:
            ring.slot_pos[:, last % W] = last
        cache.positions.fill_(context)
        self.model, self.cache, self.fused = model, cache, fused
        self.fd = (FastDecoder(model, tier, batch, cache=cache, backend=backend, out_layout=out_layout,
                               pdl=pdl) if fused else None)
        if graph:
            if not fused:
                raise ValueError("the reference ESSH.step synchronises with the host; it runs eager only")
            self.fd.capture(preserve_cache=False)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fd.step(tokens) if self.fused else self.model.step(tokens, self.cache)

    def reset(self) -> None:
        """Nothing to reset: the ring buffer and the recurrent state never run out of room."""

    def state_bytes(self) -> dict[str, int]:
        return self.cache.nbytes()


class TransformerDecoder:
    """Transformer++ with a static KV cache of ``context + margin`` slots, the first ``context`` filled."""

    def __init__(self, model, batch: int, context: int, graph: bool, margin: int = 320) -> None:
        self.model, self.context = model, context
        self.cache = model.allocate_cache(batch, context + margin)
        _fill_random(self.cache.keys[:, :, :, :context])
        _fill_random(self.cache.values[:, :, :, :context])
        self.cache.positions.fill_(context)
        dev = model.embed.weight.device
        self._graph = GraphedStep(lambda t: model.step(t, self.cache), batch, dev) if graph else None
        self.reset()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._graph(tokens) if self._graph is not None else self.model.step(tokens, self.cache)

    def reset(self) -> None:
        """Back to ``context`` cached tokens (each session stays within the static cache)."""
        self.cache.positions.fill_(self.context)

    def state_bytes(self) -> dict[str, int]:
        keys = self.cache.keys        # [N, B, H, L, hd]
        return state_bytes(self.model.config, None, keys.shape[1], kv_dtype_bytes=keys.element_size(),
                           context=self.context)


def bench_decode(make: Callable[[int, bool], object], batch: int, graph: bool, warmup: int, iters: int,
                 vocab: int, device: torch.device, sessions: int = 1) -> dict:
    """Median ms per decode step of ``make(batch, graph)``; OOM is reported, not raised.

    Returns ``{"batch", "mode", "ms", "ms_min", "ms_spread", "n", "tok_s", "state_bytes_per_seq"}`` or
    ``{"batch", "mode", "error": "OOM" | message}``."""
    row: dict = {"batch": batch, "mode": "graph" if graph else "eager"}
    with oom_as_result(row, device):
        dec = make(batch, graph)
        tokens = torch.randint(0, vocab, (batch,), device=device)
        times: list[float] = []
        for _ in range(sessions):
            dec.reset()
            times += time_fn(lambda: dec.step(tokens), warmup, iters, device)
        row.update(summarize(times))
        row["tok_s"] = batch / row["ms"] * 1e3
        row["state_bytes_per_seq"] = dec.state_bytes()["total"] // batch
    return row


def peer_model(r, peer: str, dtype: torch.dtype | str = "bench", training: bool = False):
    """(model, make_decoder(batch, graph), params info) of a peer, its matrices in the bench dtype (or ``dtype``), or
    raise with the reason it is absent (``training``: also when fla cannot train it)."""
    cfg, dtype = r.cfg, r.dtype if dtype == "bench" else dtype
    if peer == "transformer":
        tcfg, info = transformer_matched(r.mcfg)
        pm = random_model(tcfg, r.dev, dtype)
        margin = cfg.warmup + cfg.iters + 8
        return pm, (lambda b, g: TransformerDecoder(pm, b, cfg.context, g, margin=margin)), info
    fla = fla_peers()
    fla.require_fla(peer)
    refused = training and fla.fla_training_refused(peer)
    if refused:
        raise PeerUnavailable(refused)
    info = fla.fla_matched(peer, r.mcfg)
    pm = fla.build_fla(peer, r.mcfg, info["d_ff"], r.dev, dtype)
    return pm, (lambda b, g: fla.FlaDecoder(pm, b, g)), info


def built_peer(r, out: list, base: dict, peer: str) -> tuple | None:
    """``peer_model(r, peer)``, its build reported as a row of ``out`` (``base`` + params, gap and FFN width; an
    absent peer: the row's ``error``), or None when it failed."""
    built = []

    def build() -> dict:
        built.append(peer_model(r, peer))
        info = built[0][2]
        return {"params": info["params"], "param_gap": info["gap"], "d_ff": info["d_ff"]}

    r.run(out, base, build)
    return built[0] if built else None


def decode_suite(r, out: list) -> None:
    """ESSH tiers x batches x modes, the unfused reference at batch 1, then every peer (full size)."""
    cfg, dev, V = r.cfg, r.dev, r.mcfg.vocab_size
    graph = cfg.graph and dev.type == "cuda"

    def sweep(base: dict, make: Callable[[int, bool], object]) -> None:
        """Every batch in graph mode on CUDA, eager for ``eager_batches`` (every batch without CUDA)."""
        for B in cfg.batches:
            for g in ([True] if graph else []) + ([False] if (B in cfg.eager_batches or not graph) else []):
                r.run(out, {**base, "batch": B, "mode": "graph" if g else "eager"},
                      lambda B=B, g=g: bench_decode(make, B, g, cfg.warmup, cfg.iters, V, dev, cfg.sessions))

    model = r.essh(compile=False) if (r.tiers or cfg.reference) else None
    for name in r.tiers:
        sweep({"bench": "decode", "model": "essh", "preset": cfg.preset, "tier": name, "params": r.table[name].params,
               "full": name == r.full}, lambda b, gg, name=name: EsshDecoder(model, name, b, cfg.context, gg))
    if cfg.reference:
        base = {"bench": "decode", "model": "essh-unfused", "preset": cfg.preset, "tier": r.full,
                "params": r.table[r.full].params, "batch": 1, "mode": "eager"}
        make = lambda b, gg: EsshDecoder(model, r.full, b, cfg.context, False, fused=False)
        fn = lambda: bench_decode(make, 1, False, min(cfg.warmup, 10), min(cfg.iters, 50), V, dev)
        r.run(out, base, fn)
    model = None
    for peer in cfg.peers:
        base = {"bench": "decode", "model": peer, "preset": cfg.preset, "tier": "-"}
        built = built_peer(r, out, {**base, "batch": 0, "mode": "build"}, peer)
        if built is not None:
            sweep({**base, "params": built[2]["params"]}, built[1])
        built = None          # the peer's memory goes before the next one is built


def bench_generate(model, tier: str, batch: int, prompt_len: int, new_tokens: int, iters: int,
                   device: torch.device) -> dict:
    """One entry: ``first_call_s`` (decoder build, graph capture, compilation), ``prefill_ms`` (``max_new_tokens=1``),
    ``total_ms``, ``ms_per_token`` = (total - prefill) / (new tokens - 1), ``step_ms`` (the pooled decoder's step)
    and their ``ratio``; medians over ``iters`` calls after one warm-up call."""
    if new_tokens < 2:
        raise ValueError("generate_new_tokens must be >= 2 (the per-token figure needs two or more)")
    row: dict = {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    with oom_as_result(row, device, peak=True):
        row["first_call_s"] = wall_ms(lambda: model.generate(ids, 2, tier=tier), device) / 1e3
        model.generate(ids, new_tokens, tier=tier)                     # warm: every graph exists now
        pre = [wall_ms(lambda: model.generate(ids, 1, tier=tier), device) for _ in range(iters)]
        tot = [wall_ms(lambda: model.generate(ids, new_tokens, tier=tier), device) for _ in range(iters)]
        row["prefill_ms"] = summarize(pre)["ms"]
        row["prefill_ktok_s"] = batch * prompt_len / row["prefill_ms"]
        row["total_ms"] = summarize(tot)["ms"]
        row["ms_per_token"] = (row["total_ms"] - row["prefill_ms"]) / (new_tokens - 1)
        fd = decoder_pool(model).get(tier, batch)
        row["graphed"] = fd.graphed
        tok = torch.zeros(batch, dtype=torch.long, device=device)
        with torch.inference_mode():
            row["step_ms"] = summarize(time_fn(lambda: fd.step(tok), 20, 100, device))["ms"]
        row["ratio"] = row["ms_per_token"] / row["step_ms"]
    return row


def generate_suite(r, out: list) -> None:
    """Every (tier, batch) of the config through ``model.generate`` (compiled when ``compile`` is set)."""
    cfg, dev = r.cfg, r.dev
    model = r.essh()
    for name in cfg.generate_tiers:
        for batch in cfg.generate_batches:
            base = {"bench": "generate", "model": "essh", "preset": cfg.preset, "tier": name,
                    "params": r.table[name].params, "compiled": cfg.compile}
            r.run(out, base, lambda name=name, batch=batch: bench_generate(
                model, name, batch, cfg.generate_prompt, cfg.generate_new_tokens, cfg.generate_iters, dev))
    model.clear_decoders()
