"""``elastic-ssm serve`` and ``elastic-ssm calibrate``, and the ``--tier auto`` choice of ``generate``."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path

from ..cli_util import announce_device, checked_tiers, listed_tier, resolve_device, resolve_dtype, spelled, status
from ..config import ConfigError

__all__ = ["auto_tier", "cmd_calibrate", "cmd_serve", "record_quality"]

API_KEY_ENV = "ELASTIC_SSM_API_KEY"


def auto_tier(checkpoint: str, args: argparse.Namespace) -> str:
    """The tier ``es.select_tier`` picks for the budget flags (one line saying which, why and from which tiers)."""
    from .select import tier_choice

    choice = tier_choice(checkpoint, max_ms_per_token=args.max_ms_per_token, max_state_bytes=args.max_state_bytes,
                         max_params=args.max_params, batch=args.budget_batch)
    status(f"--tier auto: {choice.line()}", file=sys.stderr)
    return choice.tier.name


def require_essh(checkpoint: str, arch: str, verb: str) -> None:
    """``ConfigError`` unless ``arch`` is ESSH (the fused decoder), saying what the others offer instead."""
    if arch == "essh":
        return
    instead = (f"decode it with `elastic-ssm generate {checkpoint} --tier K<k>` (ESSSM.generate in Python)"
               if arch == "es_ssm" else "the Transformer++ and MatFormer baselines are for training and "
               "`elastic-ssm eval` (docs/baselines.md)")
    raise ConfigError(f"{checkpoint} holds a model of arch {arch!r}; `elastic-ssm {verb}` runs ESSH models only (the "
                      f"fused decoder): {instead}")


def _check_bind(host: str, port: int) -> int:
    """``ConfigError`` unless this process can listen on ``host:port``; the port bound (for 0, the one picked)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror}); give an address of this machine, e.g. "
                          "127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); choose another "
                              "--port (0: any free one) or an address of this machine") from None
        return s.getsockname()[1]


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError:
        raise ConfigError("serving needs the serve extra: pip install 'elastic-ssm[serve]'") from None
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from ..data.tokenizers import resolve_tokenizer
    from ..models import load_pretrained
    from .app import ServerSettings, create_app
    from .guard import is_loopback, uvicorn_connection_limit
    from .header_deadline import with_header_deadline
    from .remote import model_view
    from .tokens import chat_template_source

    chat_template = chat_template_source(args.chat_template)      # before the model loads: a typo costs nothing
    name = args.name if args.name is not None else Path(args.checkpoint).resolve().name
    if "@" in name or not name.strip():           # the directory's name too: every id of /v1/models was a 404
        given = args.name is not None
        raise ConfigError(f"{'--name' if given else 'the model directory name'} {name!r}: a model name cannot contain "
                          f"'@' (model ids are NAME@TIER){'' if given else '; serve it under another with --name'}")
    _check_bind(args.host, args.port)             # before the model loads: a bad address fails in a second
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = model_view(args.checkpoint)       # the weights load in the engine process (serve/remote.py)
    require_essh(args.checkpoint, model.arch, "serve")
    model.tokenizer = resolve_tokenizer(model, args.tokenizer)   # the saved one; bytes for a model saved without
    table = [t.name for t in model.tier_table()]
    tiers = checked_tiers(model, args.tiers) or table
    named = None if args.tier in (None, "auto") else model.resolve_tier(listed_tier(args.tier)).name  # full: largest
    if named is not None and named not in tiers:
        raise ConfigError(f"--tier {args.tier} is not one of the served --tiers {','.join(tiers)}; add it to --tiers, "
                          "or pick one of them")
    default = auto_tier(args.checkpoint, args) if args.tier == "auto" else named or tiers[-1]
    if default not in tiers:                     # --tier auto picked a tier outside --tiers: it is served too
        status(f"--tier auto picked {default}, which --tiers does not list; serving it too", file=sys.stderr)
    tiers = sorted(set(tiers) | {default}, key=table.index)
    check_state_fits(model.config, tiers[-1], args.max_batch, device,     # one pool, at the widest tier
                     f"{spelled(args, 'max_batch')} {args.max_batch}", weight_bytes(model, dtype))
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("elastic_ssm.serve")
    if not is_loopback(args.host) and key is None:
        log.warning("listening on %s without an API key: anyone who can reach this address can use the model; "
                    "set --api_key or %s", args.host, API_KEY_ENV)
    announce_device("serve", device, dtype)
    same = ("max_prefill_tokens", "prefill_wait_ms", "prefill_graphs", "prefill_graph_tokens", "attended_spans",
            "max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens_limit", "max_connections_per_client")
    settings = ServerSettings(name=name, tiers=tiers, default_tier=default, slots=args.max_batch, api_key=key,
                              max_prefill=min(args.max_prefill or args.max_batch, args.max_batch),
                              max_requests=args.max_connections, timeout_s=args.timeout, chat_template=chat_template,
                              allowed_hosts=(args.host, *filter(None, (args.allowed_hosts or "").split(","))),
                              **{k: getattr(args, k) for k in same})
    app = create_app(model, settings, load=functools.partial(load_pretrained, args.checkpoint, device=device,
                                                             dtype=dtype))
    try:
        try:
            app.state.engine.start()
        except RuntimeError as e:
            raise ConfigError(f"{args.checkpoint}: {e}") from None
        # --port 0: pick the free port now, after the model loaded, so the line below can name it
        port = _check_bind(args.host, args.port) if args.port == 0 else args.port
        log.info("serving %s tiers %s (default %s), %d slots shared by every tier, on http://%s:%d (%s)", name,
                 ",".join(tiers), default, args.max_batch, args.host, port, http_stack())
        uvicorn.run(app, host=args.host, port=port, log_level="warning", timeout_keep_alive=5,
                    limit_concurrency=uvicorn_connection_limit(args.max_connections),
                    proxy_headers=bool(args.forwarded_allow_ips), forwarded_allow_ips=args.forwarded_allow_ips or None,
                    http=with_header_deadline(AutoHTTPProtocol, args.timeout, app.state.metrics.reject,
                                              max_header_bytes=args.max_header_bytes, write_timeout=args.timeout))
    finally:
        app.state.engine.shutdown()
    return 0


def http_stack() -> str:
    """Which event loop and HTTP parser uvicorn's ``auto`` picks here (uvloop and httptools when installed)."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio (pip install uvloop: faster)"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11 (pip install httptools: faster)"
    return f"event loop {loop}, HTTP {http}"


def _device_memory(device) -> int | None:
    """Bytes of memory on ``device`` (a GPU's total, the host's physical memory), or None when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":        # the properties, not mem_get_info: that would make a CUDA context in this process
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def weight_bytes(model, dtype=None) -> int:
    """Bytes of ``model``'s parameters, at ``dtype`` when given (a meta-device view's weights as they will load)."""
    return sum(p.numel() * (dtype.itemsize if dtype is not None else p.element_size()) for p in model.parameters())


def check_state_fits(config, tier: str, batch: int, device, flag: str, weights: int = 0) -> None:
    """``ConfigError`` naming ``flag`` when the decode state of ``batch`` sequences at ``tier`` (Table 53) and
    ``weights`` bytes exceed ``device``'s memory, before any allocation."""
    from ..elastic.tiers import state_bytes

    state = state_bytes(config, tier, batch)["total"]
    have = _device_memory(device)
    if have is not None and state + weights > have:
        beside = f" beside the weights' {weights / 2**30:,.1f} GiB" if weights and state <= have else ""
        raise ConfigError(f"{flag}: the decode state of {batch} sequences at {tier} needs {state / 2**30:,.1f} GiB"
                          f"{beside}, more than this device's {have / 2**30:,.1f} GiB; give a smaller batch")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..cli_util import load_model
    from .select import calibrate, write_profile

    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ConfigError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1:
        raise ConfigError(f"--batches must be integers >= 1, got {args.batches!r}")
    model, device = load_model(args, dtype=args.dtype)
    require_essh(args.checkpoint, model.arch, "calibrate")
    tiers = checked_tiers(model, args.tiers)          # the tier-list parser of every verb: "T1, T4" is T1, T4
    weights = weight_bytes(model)
    for t in tiers or [x.name for x in model.tier_table()]:    # one tier and batch at a time
        check_state_fits(model.config, t, max(batches), device, f"--batches {args.batches}", weights)
    announce_device("calibrate", device, resolve_dtype(args.dtype, device))
    profile = calibrate(model, batches, tiers, warmup=args.warmup, iters=args.iters, show_progress=not args.quiet)
    print(f"wrote {write_profile(args.checkpoint, profile, notice=lambda line: status(line, file=sys.stderr))}")
    return 0


def record_quality(args: argparse.Namespace, rows, model, window: int) -> None:
    """``eval --write_quality``: ``rows`` of ``model`` into tier_quality.json (``window``: the longest length)."""
    from .select import quality_table, write_quality

    if not args.write_quality:
        return
    weight = next(model.parameters())
    table = quality_table(rows, args.data, args.split, args.quality_metric, window=window, batch_size=args.batch_size,
                          n_batches=args.n_batches, tokenizer=args.tokenizer or "saved", device=weight.device.type,
                          dtype=str(weight.dtype).replace("torch.", ""))
    try:
        path = write_quality(args.checkpoint, table, notice=lambda line: status(line, file=sys.stderr))
    except OSError as e:   # asked for and not written: an error (the results above are printed, and in --csv)
        raise ConfigError(f"--write_quality: could not write tier_quality.json into {args.checkpoint} "
                          f"({e.strerror or e}); the results are printed above; evaluate a copy of the directory, "
                          "or run without --write_quality") from None
    print(f"wrote {path}")
