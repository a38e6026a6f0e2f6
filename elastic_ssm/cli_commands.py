"""The ``elastic-ssm`` verbs that train, export, generate and prepare data (info, train, recover, export, generate,
prepare under a one-writer lock on its output (docs/data.md), tokenizer train, bench, quickstart); model code is
imported inside them (``--help`` stays light)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import signal
import sys
import tempfile
from itertools import islice
from pathlib import Path

from .cli_util import (
    announce_device,
    check_replaceable,
    checked_tiers,
    listed_tier,
    load_model,
    overrides,
    refuse_existing,
    report,
    spelled,
    status,
    tier_names,
    write_csv,
)
from .config import ConfigError
from .utils.files import check_output_path, is_temp_name, process_umask, read_json
from .utils.progress import format_table, progress, shown


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from . import __version__
    from .ops.dispatch import available_backends
    from .utils.environment import library_versions

    print(f"elastic_ssm {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    for mod, version in library_versions(("triton", "fla", "safetensors", "tokenizers", "transformers",
                                          "lm_eval")).items():
        print(f"  {mod:<13}{version or 'not installed'}")
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device: {dev}   threads: {torch.get_num_threads()}")
    print(f"scan backends available: {', '.join(available_backends())}")
    return 0


def load_run_config(args: argparse.Namespace):
    """The run file ``parse`` read (``--config``, else ``DEFAULT_RUN``) with the ``--model/train/data.*`` flags."""
    base, model = args.options_cls.run, overrides(args, "model")
    choice = {k: model.pop(k) for k in ("arch", "preset", "tier_config") if k in model}
    base = base.with_model_choice(**choice) if choice else base
    return base.with_overrides(model, overrides(args, "train"), overrides(args, "data"))


def _training(verb: str, args: argparse.Namespace, run) -> int:
    """``run(resume, progress)``; a stopped run (checkpointed) is one line and the signal's exit code."""
    from .train.preflight import TrainingInterrupted

    try:
        run({None: False, "yes": True}.get(args.resume, args.resume), "lines" if args.quiet else True)
    except TrainingInterrupted as e:
        report(verb, str(e))
        return 128 + int(getattr(signal, e.signame, signal.SIGTERM))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .pipeline import run_training

    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --train.out_dir and --overwrite replaces it; give one")
    run = load_run_config(args)
    check_output_path("--train.out_dir", run.train.out_dir, "folder")   # before any data (preflight checks again)
    return _training("train", args, lambda resume, progress: run_training(
        run, resume=resume, overwrite=args.overwrite, stop_after=args.stop_after or None,
        verify_data=args.verify_data, progress=progress))


def cmd_recover(args: argparse.Namespace) -> int:
    """``recover PARENT``: truncate a saved ESSH and recover it by ``--protocol refine`` (Tables 33/43),
    ``label_only`` (Table 43) or ``posthoc`` (E.7); per-tier tables before and after, ``recovery.csv``
    (``train/recover.py``)."""
    from .pipeline import build_data
    from .train.recover import truncate_and_recover

    parent, device = load_model(args, args.parent)
    if not hasattr(parent, "ffn_layers") or parent.arch != "essh":
        raise ConfigError(f"{args.parent} holds a {parent.arch!r} model; recover truncates an ESSH")
    run = load_run_config(args)                  # its model is replaced by the parent's below
    t = run.train.replace(device=device)
    if args.steps:
        t = t.replace(refine=t.refine.replace(steps=args.steps))
    run = dataclasses.replace(run, model=parent.config, train=t)
    tiers = checked_tiers(parent, args.tiers)          # the tier-list parser of every verb
    _check_recovery(args, parent, t, tiers)
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
    status(format_table(rows, ["tier", "params", "bpb_truncated", "bpb_recovered"]))
    Path(t.out_dir).mkdir(parents=True, exist_ok=True)
    write_csv(str(Path(t.out_dir) / "recovery.csv"), rows, args.overwrite, flag="--train.out_dir")
    return 0


def _check_recovery(args: argparse.Namespace, parent, t, tiers: list[str] | None) -> None:
    """What the recovery would reject only after evaluating the truncated model (minutes at scale): its length,
    post-hoc masks, run directories that are files or hold another run, an earlier ``recovery.csv``."""
    from .train.recover import posthoc_train_config
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
    for d in [out / n for n in names] if args.protocol == "label_only" else [out]:
        check_output_path("--train.out_dir", str(d), "folder")
        found = [] if args.overwrite else run_artifacts(d)
        if found:
            raise ConfigError(f"{d} already holds another run ({', '.join(found[:3])}); pass --overwrite (moves it "
                              "aside) or choose another --train.out_dir")
    check_replaceable(str(out / "recovery.csv"), args.overwrite, "--train.out_dir")   # also beside label_only tiers


def cmd_export(args: argparse.Namespace) -> int:
    from .models import check_export, export_tier
    from .train.rundir import RunLock

    model, device = load_model(args)
    names = checked_tiers(model, args.tiers) or [t.name for t in model.tier_table()]
    limit = model.config.max_seq_len()             # an ES-SSM's filter length: the default check fits it
    if limit is not None and "check_len" not in args._given:
        args.check_len = min(args.check_len, limit)
    if limit is not None and args.check_len > limit:
        raise ConfigError(f"{spelled(args, 'check_len')} {args.check_len}: exceeds this {model.arch} model's filter "
                          f"length {limit}, the longest sequence it accepts; give --check_len {limit} or less")
    out = Path(args.out)
    failed = 0
    with RunLock(out, owner="export", flag="--out"):   # one writer: two exports never interleave a tier's files
        occupied = _occupied_tier_folders(out, names, args.overwrite, Path(args.checkpoint))   # before any export
        announce_device("export check", device, next(model.parameters()).dtype)
        tolerance = 0.0 if device == "cpu" else 1e-4   # bitwise on CPU; GPU kernels may pick other reductions
        for name in progress(names, desc="export + check", unit="tier", enabled=not args.quiet):
            small = export_tier(model, name)
            res = check_export(model, name, standalone=small, seq_len=args.check_len, tolerance=tolerance)
            print(res)
            if not res.ok:
                failed += 1
                print(f"  {name}: export check failed; not written" + (" (the folder keeps its old files)"
                                                                       if name in occupied else ""))
                continue
            if name in occupied:
                _replace_folder(out / name, small.save_pretrained)
            else:
                small.save_pretrained(out / name)
    print(f"wrote {len(names) - failed} standalone model(s) under {out}")
    return 1 if failed else 0


def _occupied_tier_folders(out: Path, names: list[str], overwrite: bool, source: Path) -> set[str]:
    """The tiers whose folder under ``out`` holds files (temporary ones aside); without ``overwrite`` one is a
    ``ConfigError``, even for the same export (its bytes vary: the weights header's order is not fixed). A folder
    that is or holds the model ``source`` is one either way (replacing it would delete the model)."""
    occupied = set()
    for name in names:
        folder = out / name
        if folder.resolve() in (source.resolve(), *source.resolve().parents):
            raise ConfigError(f"--out {out}: {folder} holds the model being exported ({source}), which tier {name}'s "
                              "folder would replace; choose another --out")
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {out}: {folder} is a file where tier {name}'s folder belongs; move it away or "
                              "choose another --out")
        held = sorted(p.name for p in folder.iterdir() if not is_temp_name(p.name)) if folder.is_dir() else []
        if held:
            occupied.add(name)
            if not overwrite:
                raise ConfigError(f"--out {out}: {folder} already holds files ({', '.join(held[:3])}"
                                  f"{', ...' if len(held) > 3 else ''}); pass --overwrite to replace them, or "
                                  "choose another --out")
    return occupied


def _replace_folder(folder: Path, write) -> None:
    """``write(path)`` into a staging folder beside ``folder``, then swapped in: the old files stay whole until then."""
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    os.chmod(staging, 0o777 & ~process_umask())    # mkdtemp's 0700 would hide the model from other users
    old = staging.with_name(staging.name.replace(".tmp", ".old.tmp"))
    try:
        write(staging)
        os.replace(folder, old)
        try:
            os.replace(staging, folder)
        except BaseException:
            os.replace(old, folder)           # put the old model back rather than leave no folder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .data.tokenizers import resolve_tokenizer
    from .models.generation import check_sampling
    from .serve.cli import auto_tier
    from .serve.tokens import TextStream

    check_sampling(args.temperature, args.top_k, args.top_p)   # before anything is printed or loaded
    try:                                   # the first byte that is not UTF-8 (a lone surrogate, PEP 383) is named
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(args.prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ConfigError(f"{spelled(args, 'prompt')} is not valid UTF-8 text ({what} at character "
                          f"{e.start}); give UTF-8 text, e.g. convert a file from its encoding with --prompt "
                          '"$(iconv -f latin1 -t utf-8 FILE)" (generate has no prompt-file option)') from None
    names = tier_names(args.tier)          # the tier-list parser of every verb: " T4" is T4
    if names is None or len(names) != 1:
        what = "every tier" if names is None else "several tiers"
        raise ConfigError(f"{spelled(args, 'tier')} {args.tier!r} names {what}; generate samples from one tier: give "
                          "one ('full', T1..T10, 'auto'; ES-SSM: 8 or K8)")
    tier = listed_tier(names[0])           # full: None; an ES-SSM budget 8 is an int
    model, device = load_model(args, tier=auto_tier(args.checkpoint, args) if tier == "auto" else tier,
                               dtype=args.dtype)
    if not hasattr(model, "generate"):
        raise ConfigError(f"{args.checkpoint} holds a {model.arch!r} model, which has no cached generation; generate "
                          "runs ESSH and ES-SSM models")
    tok = resolve_tokenizer(model, args.tokenizer)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise ConfigError(f"{spelled(args, 'prompt')} is empty: give at least one character")
    limit = model.config.max_seq_len()    # checked before the prompt is echoed (decoding may run past it)
    if limit is not None and ids.shape[1] > limit:
        raise ConfigError(f"{spelled(args, 'prompt')} is {ids.shape[1]} tokens, more than the {limit} this "
                          f"{model.arch} model reads at once (its filter length); give a shorter prompt")
    announce_device("generate", device, next(model.parameters()).dtype)
    g = torch.Generator(device=device).manual_seed(args.seed)
    sys.stdout.write(args.prompt)
    text = TextStream(tok, [])             # the server's decoding: multi-byte characters and subwords survive

    def stream(t: torch.Tensor) -> None:
        sys.stdout.write(text.push(int(t[0])))
        sys.stdout.flush()

    try:
        model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       streamer=stream, generator=g, do_sample=args.temperature > 0)
    finally:                               # an error's line starts on its own line, after the text so far
        print(text.finish(), flush=True)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from .data import prepare
    from .data.tokenfile import sidecar_path
    from .train.rundir import RunLock

    out = Path(args.out)
    if out.suffix != ".bin":      # another name is refused by prepare, before any work, whether it exists or not
        return _prepare(args, prepare)
    lock = RunLock(out.parent, owner=f"prepare writing {out.name}", flag="OUT", name=f".{out.name}.lock")
    with lock.undone_on_failure(remove=True):   # its own lock file goes; a refused prepare leaves no folder either
        for p in sorted(out.parent.iterdir()):    # the temporary files an interrupted prepare of OUT left
            if p.is_file() and is_temp_name(p.name) and p.name.startswith(f".{out.name}."):
                p.unlink(missing_ok=True)
                print(f"[prepare] removed {p} (temporary file of an interrupted prepare of {out.name})",
                      file=sys.stderr)
        refuse_existing(args, out, sidecar_path(out))      # the tokens and their .json sidecar are one output
        return _prepare(args, prepare)


def _prepare(args: argparse.Namespace, prepare) -> int:
    tf = prepare(args.source, args.out, args.tokenizer, split=args.split, text_field=args.text_field,
                 max_tokens=args.max_tokens or None, show_progress=not args.quiet)
    print(f"wrote {len(tf):,} tokens to {args.out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from .data import train_bpe

    check_replaceable(args.out, args.overwrite, "--out", "a tokenizer.json",    # an object with a model mapping
                      lambda p: isinstance(rec := read_json(p), dict) and isinstance(rec.get("model"), dict))
    tok = train_bpe(args.source, args.vocab_size, args.out, max_bytes=args.max_bytes or None,
                    show_progress=shown(not args.quiet))
    print(f"trained a {tok.vocab_size}-entry BPE tokenizer -> {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench_command

    bench_command(overrides(args, "bench"))
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import quickstart

    return _training("quickstart", args, lambda resume, progress: quickstart(
        out_dir=args.out, steps=args.steps, control=args.control, config=args.config, overwrite=args.overwrite,
        resume=resume, progress=progress))
