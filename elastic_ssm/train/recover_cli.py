"""``elastic-ssm recover PARENT``: truncate a saved ESSH and recover it by one of the paper's protocols.

    elastic-ssm recover runs/dense/final --protocol refine --steps 200 --train.out_dir runs/dense-recovered

``--protocol refine`` (the dense control of Tables 33/43), ``label_only`` (Table 43's label-only recovery of
each tier at its fixed shape) or ``posthoc`` (E.7: calibration ranking, nested masks, forward KL + CE under
the frozen parent, constant lr 1e-4). Data and training settings come from a run YAML plus ``--train.*`` /
``--data.*`` flags; the recovery length is ``train.refine.steps`` (``--steps``). Prints the per-tier table
before and after and writes ``recovery.csv`` into ``train.out_dir`` (``train/recover.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

__all__ = ["add_recover_parser"]


def cmd_recover(args: argparse.Namespace) -> int:
    from itertools import islice

    from ..cli_args import collect_overrides, resolve_device, write_csv
    from ..config import ConfigError
    from ..models import load_pretrained
    from ..pipeline import build_data
    from ..run_config import RunConfig
    from .recover import truncate_and_recover

    device = resolve_device(args.device)
    parent = load_pretrained(args.parent, device=device)
    if not hasattr(parent, "ffn_layers") or parent.arch != "essh":
        raise ConfigError(f"{args.parent} holds a {parent.arch!r} model; recover truncates an ESSH")
    base = RunConfig.from_yaml(args.config) if args.config else RunConfig.from_yaml(_default_run())
    run = base.with_overrides({}, collect_overrides(args, "train"), collect_overrides(args, "data"))
    train_cfg = run.train.replace(device=device)
    if args.steps:
        train_cfg = train_cfg.replace(refine=train_cfg.refine.replace(steps=args.steps))
    run = dataclasses.replace(run, model=parent.config, train=train_cfg)
    data = build_data(run)
    t = run.train
    tiers = None if args.tiers == "all" else [parent.resolve_tier(n).name for n in args.tiers.split(",")]
    calibration = None
    if args.protocol == "posthoc":
        make = data.batches(t.seq_len, t.micro_batch_size, t.seed + 1)   # not the recovery's own order
        calibration = list(islice(iter(make(0, 1)), args.calibration_batches))
    print(f"[recover] {args.parent}: protocol {args.protocol}, {t.refine.steps} steps into {t.out_dir}")
    rec = truncate_and_recover(parent, data.batches(t.seq_len, t.micro_batch_size, t.seed), t, data.val_batches,
                               protocol=args.protocol, tiers=tiers, bytes_per_token=data.bytes_per_token,
                               calibration=calibration, masks=tuple(args.masks) if args.masks else None,
                               channel_order=args.channel_order, overwrite=args.overwrite)
    rows = rec.rows()
    print(_table(rows))
    Path(t.out_dir).mkdir(parents=True, exist_ok=True)
    write_csv(str(Path(t.out_dir) / "recovery.csv"), rows)
    return 0


def _default_run() -> Path:
    return Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'tier':<6}{'params':>14}{'bpb truncated':>16}{'bpb recovered':>16}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['tier']:<6}{r['params']:>14,}{r['bpb_truncated']:>16.4f}{r['bpb_recovered']:>16.4f}" for r in rows]
    return "\n".join(lines)


def add_recover_parser(sub: Any) -> None:
    """Add the ``recover`` verb to the CLI's sub-parsers (flags derived from TrainConfig / DataConfig)."""
    from ..cli_args import _parse_scalar, add_dataclass_flags, add_device_flag
    from ..run_config import DataConfig
    from .config import TrainConfig
    from .recover import PROTOCOLS

    s = sub.add_parser("recover", help="truncate a saved ESSH and recover it (dense control, label-only, "
                                       "post-hoc elastification); tables before/after")
    s.add_argument("parent", help="model directory of the trained (e.g. dense) ESSH")
    s.add_argument("--protocol", default="refine", choices=PROTOCOLS,
                   help="refine: shared refinement of the truncated model (Tables 33/43); label_only: each tier "
                        "at its fixed shape with CE only (Table 43); posthoc: E.7 ranking + masked recovery")
    s.add_argument("--config", help="run YAML for data and training settings (default: the quickstart's)")
    s.add_argument("--steps", type=int, default=0, help="recovery steps (0: train.refine.steps of the run file)")
    s.add_argument("--tiers", default="all", help="'all' or comma-separated tiers to evaluate (label_only: train)")
    s.add_argument("--masks", nargs="+", type=_parse_scalar(float), default=None,
                   help="posthoc: mask capacity fractions, full first (default train.capacities)")
    s.add_argument("--calibration-batches", type=int, default=16,
                   help="posthoc: training micro-batches for the ranking (E.7: 2M tokens)")
    s.add_argument("--channel-order", default="original", choices=("original", "energy"),
                   help="posthoc: keep the spectral channels' order (E.7) or rank them by output energy")
    s.add_argument("--overwrite", action="store_true", help="move another run in train.out_dir aside")
    add_device_flag(s)
    add_dataclass_flags(s, TrainConfig, "train")
    add_dataclass_flags(s, DataConfig, "data")
    s.set_defaults(fn=cmd_recover)
