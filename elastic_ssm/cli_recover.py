"""``elastic-ssm recover PARENT``: truncate a saved ESSH and recover it by ``--protocol refine`` (Tables 33/43),
``label_only`` (Table 43) or ``posthoc`` (E.7); per-tier tables before and after, ``recovery.csv``
(``train/recover.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

__all__ = ["cmd_recover"]


def cmd_recover(args: argparse.Namespace) -> int:
    from itertools import islice

    from .cli_commands import load_run_config
    from .cli_util import checked_tiers, resolve_device, status, write_csv
    from .config import ConfigError
    from .models import load_pretrained
    from .pipeline import build_data
    from .train.recover import truncate_and_recover

    device = resolve_device(args.device)
    parent = load_pretrained(args.parent, device=device)
    if not hasattr(parent, "ffn_layers") or parent.arch != "essh":
        raise ConfigError(f"{args.parent} holds a {parent.arch!r} model; recover truncates an ESSH")
    run = load_run_config(args)                  # its model is replaced by the parent's below
    train_cfg = run.train.replace(device=device)
    if args.steps:
        train_cfg = train_cfg.replace(refine=train_cfg.refine.replace(steps=args.steps))
    run = dataclasses.replace(run, model=parent.config, train=train_cfg)
    t = run.train
    tiers = checked_tiers(parent, args.tiers)          # the tier-list parser of every verb
    _check_before_work(args, parent, t, tiers)
    data = build_data(run)
    calibration = None
    if args.protocol == "posthoc":
        make = data.batches(t.seq_len, t.micro_batch_size, t.seed + 1)   # not the recovery's own order
        calibration = list(islice(iter(make(0, 1)), args.calibration_batches))
    status(f"[recover] {args.parent}: protocol {args.protocol}, {t.refine.steps} steps into {t.out_dir}")
    # run.yaml of the recovery (as train writes its own): the settings it ran with and where its weights came from
    record = {"recover": {"source": str(args.parent), "protocol": args.protocol}, **run.to_dict()}
    rec = truncate_and_recover(parent, data.batches(t.seq_len, t.micro_batch_size, t.seed), t, data.val_batches,
                               protocol=args.protocol, tiers=tiers, bytes_per_token=data.bytes_per_token,
                               calibration=calibration, masks=tuple(args.masks) if args.masks else None,
                               channel_order=args.channel_order, overwrite=args.overwrite,
                               progress="lines" if args.quiet else True, record=record)
    rows = rec.rows()
    status(_table(rows))
    Path(t.out_dir).mkdir(parents=True, exist_ok=True)
    write_csv(str(Path(t.out_dir) / "recovery.csv"), rows, args.overwrite, flag="--train.out_dir")
    return 0


def _check_before_work(args: argparse.Namespace, parent: Any, t: Any, tiers: list[str] | None) -> None:
    """What the recovery would reject only after evaluating the truncated model (minutes at scale): its length,
    post-hoc masks, run directories that are files or hold another run, an earlier ``recovery.csv``."""
    from .cli_util import check_csv_target
    from .config import ConfigError
    from .train.posthoc import posthoc_train_config
    from .train.rundir import run_artifacts

    if t.refine.steps < 1:
        raise ConfigError("recovery length is train.refine.steps (or --steps); set it >= 1 (the paper: 2060 steps "
                          "for refinement and post-hoc-matched runs, 4120 for label-only)")
    if args.protocol == "posthoc":
        try:
            posthoc_train_config(t, tuple(args.masks) if args.masks else None)   # the masks as capacities
        except ConfigError as e:
            raise ConfigError(f"--masks {' '.join(map(str, args.masks or ()))}: {e}") from None
    out = Path(t.out_dir)
    names = tiers or [x.name for x in parent.tier_table()]
    runs = [out / n for n in names] if args.protocol == "label_only" else [out]
    for d in runs:
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--train.out_dir: {d} is a file; choose a directory path")
        found = [] if args.overwrite else run_artifacts(d)
        if found:
            raise ConfigError(f"{d} already holds another run ({', '.join(found[:3])}); pass --overwrite (moves it "
                              "aside) or choose another --train.out_dir")
    check_csv_target(str(out / "recovery.csv"), args.overwrite, "--train.out_dir")   # also beside label_only tiers


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'tier':<6}{'params':>14}{'bpb truncated':>16}{'bpb recovered':>16}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['tier']:<6}{r['params']:>14,}{r['bpb_truncated']:>16.4f}{r['bpb_recovered']:>16.4f}" for r in rows]
    return "\n".join(lines)
