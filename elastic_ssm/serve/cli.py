"""``elastic-ssm serve`` and ``elastic-ssm calibrate``, and the ``--tier auto`` budget flags of ``generate``.

``add_parsers(sub)`` registers both subcommands on the main parser (``elastic_ssm/cli.py``); their bodies
live here so the main CLI only lists them. ``serve`` loads one checkpoint once and serves the tiers
named by ``--tiers`` (every tier a prefix view of the same weights), on 127.0.0.1 unless ``--host`` says
otherwise; ``--api-key`` (or ``ELASTIC_SSM_API_KEY``) guards every endpoint but ``/health``.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import sys
from pathlib import Path

from ..cli_args import add_device_flag, announce_device, resolve_device
from ..config import ConfigError

__all__ = ["add_parsers", "add_budget_flags", "auto_tier", "cmd_serve", "cmd_calibrate"]

API_KEY_ENV = "ELASTIC_SSM_API_KEY"


def add_budget_flags(s: argparse.ArgumentParser) -> None:
    """The budgets ``--tier auto`` is chosen under (``es.select_tier``)."""
    s.add_argument("--max-ms-per-token", type=float, default=None,
                   help="--tier auto: latency budget per stream (needs tier_profile.json: elastic-ssm calibrate)")
    s.add_argument("--max-state-bytes", type=int, default=None, help="--tier auto: state budget per sequence")
    s.add_argument("--max-params", type=int, default=None, help="--tier auto: parameter budget")
    s.add_argument("--budget-batch", type=int, default=1, help="--tier auto: decode batch the budget is for")


def auto_tier(checkpoint: str, args: argparse.Namespace, progress=print) -> str:
    """The tier ``es.select_tier`` picks for the budget flags (one line saying which and why)."""
    from .select import select_tier

    t = select_tier(checkpoint, max_ms_per_token=args.max_ms_per_token, max_state_bytes=args.max_state_bytes,
                    max_params=args.max_params, batch=args.budget_batch)
    progress(f"--tier auto: {t.name} ({t.params:,} parameters) fits the budget", file=sys.stderr)
    return t.name


def _weights_dtype(name: str, device: str):
    """``--dtype``: auto = bfloat16 on CUDA (the fused decoder's format), float32 elsewhere."""
    import torch

    return {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
            "bfloat16": torch.bfloat16}[name]


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise ConfigError("serving needs the serve extra: pip install 'elastic-ssm[serve]'") from None

    from ..models import load_pretrained
    from .app import ServerSettings, create_app
    from .remote import model_view

    if args.max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {args.max_batch}")
    device = resolve_device(args.device)
    dtype = _weights_dtype(args.dtype, device)
    model = model_view(args.checkpoint)       # the weights load in the engine process (serve/remote.py)
    if model.arch != "essh":
        raise ConfigError(f"{args.checkpoint} holds an {model.arch!r} model; serving runs the fused ESSH decoder")
    table = [t.name for t in model.tier_table()]
    tiers = table if args.tiers == "all" else [model.resolve_tier(t.strip()).name for t in args.tiers.split(",")]
    default = auto_tier(args.checkpoint, args) if args.tier == "auto" else (
        tiers[-1] if args.tier is None else model.resolve_tier(args.tier).name)
    tiers = sorted(set(tiers) | {default}, key=table.index)
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    name = args.name or Path(args.checkpoint).resolve().name
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("elastic_ssm.serve")
    if not _is_local(args.host) and key is None:
        log.warning("listening on %s without an API key: anyone who can reach this address can use the model; "
                    "set --api-key or %s", args.host, API_KEY_ENV)
    announce_device("serve", device, dtype)
    settings = ServerSettings(name=name, tiers=tiers, default_tier=default, slots=args.max_batch, api_key=key,
                              max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                              max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                              max_connections_per_client=args.max_connections_per_client,
                              body_timeout_s=args.timeout, stall_timeout_s=args.timeout)
    app = create_app(model, settings, load=functools.partial(load_pretrained, args.checkpoint, device=device,
                                                             dtype=dtype))
    try:
        try:
            app.state.engine.start()
        except RuntimeError as e:
            raise ConfigError(f"{args.checkpoint}: {e}") from None
        log.info("serving %s tiers %s (default %s), %d slots each, on http://%s:%d", name, ",".join(tiers),
                 default, args.max_batch, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=5,
                    limit_concurrency=args.max_connections)
    finally:
        app.state.engine.shutdown()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:

    from ..models import load_pretrained
    from .calibrate import calibrate, write_profile

    device = resolve_device(args.device)
    dtype = _weights_dtype(args.dtype, device)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ConfigError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1:
        raise ConfigError(f"--batches must be integers >= 1, got {args.batches!r}")
    model = load_pretrained(args.checkpoint, device=device, dtype=dtype)
    if model.arch != "essh":
        raise ConfigError(f"{args.checkpoint} holds an {model.arch!r} model; calibration times the fused ESSH "
                          "decoder")
    announce_device("calibrate", device, dtype)
    tiers = None if args.tiers == "all" else [model.resolve_tier(t).name for t in args.tiers.split(",")]
    profile = calibrate(model, batches, tiers, warmup=args.warmup, iters=args.iters)
    print(f"wrote {write_profile(args.checkpoint, profile)}")
    return 0


def add_parsers(sub) -> None:
    """Register ``serve`` and ``calibrate`` on the main CLI's subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server of every tier of one checkpoint "
                                     "(needs the serve extra)")
    s.add_argument("checkpoint", help="model directory (with its tokenizer)")
    s.add_argument("--tiers", default="all", help="'all' or comma-separated tiers to serve (T1,T4,T10)")
    s.add_argument("--tier", default=None, help="default tier (model id without '@'): a served tier or 'auto' "
                                                "(es.select_tier under the budget flags); default: the largest")
    add_budget_flags(s)
    s.add_argument("--name", default=None, help="model name in the API (default: the directory's name)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    s.add_argument("--max-batch", type=int, default=16, help="slots per tier: the decode batch of its pool")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting per tier before 503")
    s.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt accepted")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    s.add_argument("--max-connections-per-client", type=int, default=32, help="concurrent requests per address")
    s.add_argument("--max-connections", type=int, default=1024, help="concurrent connections in all")
    s.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a client may take to send its body or to read pending output before its "
                        "request is dropped and its slot freed")
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights: auto = bfloat16 on CUDA, float32 on CPU")
    add_device_flag(s)
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("calibrate", help="measure ms/token of every tier on this device (served decode path) "
                                         "into the model directory's tier_profile.json")
    s.add_argument("checkpoint", help="model directory")
    s.add_argument("--batches", default="1,16,128", help="decode batch sizes to time")
    s.add_argument("--tiers", default="all", help="'all' or comma-separated tier names")
    s.add_argument("--warmup", type=int, default=5, help="untimed steps per entry")
    s.add_argument("--iters", type=int, default=20, help="timed steps per entry")
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights: auto = bfloat16 on CUDA, float32 on CPU")
    add_device_flag(s)
    s.set_defaults(fn=cmd_calibrate)


def record_quality(args: argparse.Namespace, rows) -> None:
    """``elastic-ssm eval``: write the per-tier quality into the model directory's tier_quality.json."""
    from .calibrate import quality_table, write_quality

    if not args.write_quality:
        return
    try:
        path = write_quality(args.checkpoint, quality_table(rows, args.data, args.split, args.quality_metric))
    except OSError as e:
        print(f"could not write tier_quality.json into {args.checkpoint} ({e}); --no-write-quality skips it",
              file=sys.stderr)
        return
    print(f"wrote {path}")


def add_eval_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--write-quality", action=argparse.BooleanOptionalAction, default=True,
                   help="record the per-tier quality in the model directory's tier_quality.json (select_tier)")
    s.add_argument("--quality-metric", default="bpb", choices=("bpb", "loss", "perplexity", "accuracy"),
                   help="the quality tier_quality.json records")
