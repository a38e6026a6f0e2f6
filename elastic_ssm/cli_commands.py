"""The ``elastic-ssm`` verbs of no single area; model code is imported inside them (``--help`` stays light)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_schema import DEFAULT_RUN
from .cli_util import (
    announce_device,
    checked_tiers,
    is_rank_zero,
    listed_tier,
    overrides,
    resolve_device,
    resolve_dtype,
    spelled,
    tier_names,
    write_csv,
)
from .config import ConfigError, tier_word
from .utils.progress import progress


def cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

    from . import __version__
    from .ops.dispatch import available_backends

    print(f"elastic_ssm {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    for mod in ("triton", "fla", "safetensors", "tokenizers", "transformers", "lm_eval"):
        try:
            m = __import__(mod)
            print(f"  {mod:<13}{getattr(m, '__version__', 'installed')}")
        except Exception:
            print(f"  {mod:<13}not installed")
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device: {dev}   threads: {torch.get_num_threads()}")
    print(f"scan backends available: {', '.join(available_backends())}")
    return 0


def load_run_config(args: argparse.Namespace):
    from .config import RunConfig

    base = RunConfig.from_yaml(DEFAULT_RUN if args.config is None else args.config)
    model = overrides(args, "model")
    choice = {k: model.pop(k) for k in ("arch", "preset", "tier_config") if k in model}
    base = base.with_model_choice(**choice) if choice else base
    return base.with_overrides(model, overrides(args, "train"), overrides(args, "data"))


def _training(verb: str, args: argparse.Namespace, run) -> int:
    """``run(resume, progress)``; a stopped run (checkpointed) is one line and the signal's exit code."""
    import signal

    from .train.preflight import TrainingInterrupted

    try:
        run({None: False, "yes": True}.get(args.resume, args.resume), "lines" if args.quiet else True)
    except TrainingInterrupted as e:
        if is_rank_zero():
            print(f"elastic-ssm {verb}: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.signame, signal.SIGTERM))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .pipeline import run_training

    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --train.out_dir and --overwrite replaces it; give one")
    run = load_run_config(args)
    return _training("train", args, lambda resume, progress: run_training(
        run, resume=resume, overwrite=args.overwrite, stop_after=args.stop_after or None,
        verify_data=args.verify_data, progress=progress))


def cmd_export(args: argparse.Namespace) -> int:
    from .elastic.export import check_export, export_tier
    from .models import load_pretrained
    from .train.rundir import RunLock

    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    names = checked_tiers(model, args.tiers) or [t.name for t in model.tier_table()]
    out = Path(args.out)
    failed = 0
    with RunLock(out, owner="export", flag="--out"):   # one writer: two exports never interleave a tier's files
        occupied = _occupied_tier_folders(out, names, args.overwrite)   # refused before any tier is exported
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


def _occupied_tier_folders(out: Path, names: list[str], overwrite: bool) -> set[str]:
    """The tiers whose folder under ``out`` holds files (temporary ones aside); without ``overwrite`` one is a
    ``ConfigError``, even for the same export (its bytes vary: the weights header's order is not fixed)."""
    from .utils.files import is_temp_name

    occupied = set()
    for name in names:
        folder = out / name
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
    import os
    import shutil
    import tempfile

    from .utils.files import process_umask

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


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from .eval.lm_harness import evaluate_tiers_on_tasks
    except ImportError as e:
        raise ConfigError(str(e)) from e
    from .bench.report import format_table

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks is empty: name at least one lm-eval task (e.g. piqa,hellaswag)")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder; give the folder of your task YAML "
                          "files")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    names = tier_names(args.tiers)
    rows = evaluate_tiers_on_tasks(args.checkpoint, tasks, tiers=names and [listed_tier(n) for n in names],
                                   tokenizer=args.tokenizer, device=resolve_device(args.device),
                                   batch_size=args.batch_size, max_length=args.max_length, limit=limit,
                                   num_fewshot=args.num_fewshot, include_path=args.include_path,
                                   precision=args.precision, progress=not args.quiet)
    print(format_table(rows, ["tier", "params", "task", "metric", "value", "stderr"]))
    write_csv(args.csv, rows, args.overwrite)
    return 0


def cmd_niah(args: argparse.Namespace) -> int:
    from .bench.report import format_table
    from .data import load_corpus
    from .data.tokenizer_files import resolve_tokenizer
    from .eval.needle import NeedleConfig, build_trials, check_fits, evaluate_needle
    from .models import load_pretrained

    cfg = NeedleConfig(context_len=args.context_len, n_pairs=args.n_pairs, condition=args.condition, seed=args.seed,
                       depths=tuple(float(d) for d in args.depths.split(",")), batch_size=args.batch_size)
    cfg.check()
    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    tok = resolve_tokenizer(model, args.tokenizer)
    filler = load_corpus(args.data, tok, split=args.split)
    tiers = checked_tiers(model, args.tiers)
    try:
        trials = build_trials(filler, tok, cfg)
        check_fits(model, trials, cfg)
    except ValueError as e:
        raise ConfigError(str(e).replace("context_len=", f"{spelled(args, 'context_len')} ")) from None
    announce_device("niah", device, next(model.parameters()).dtype)
    rows = evaluate_needle(model, filler, tok, tiers, cfg, precision=args.precision, trials=trials,
                           progress=not args.quiet)
    depth_cols = list(rows[0]["by_depth"])
    flat = [{**{k: v for k, v in r.items() if k != "by_depth"}, **{f"d{d}": v for d, v in r["by_depth"].items()}}
            for r in rows]
    print(format_table(flat, ["tier", "params", "margin_win", "first_token", "full_key", "half_width",
                              *[f"d{d}" for d in depth_cols]],
                       title=f"NIAH, {cfg.n_pairs} key pairs x {len(cfg.depths)} depths, context {cfg.context_len}, "
                             f"{cfg.condition} condition"))
    write_csv(args.csv, flat, args.overwrite)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .data.tokenizer_files import resolve_tokenizer
    from .models import load_pretrained
    from .models.generation import check_sampling
    from .serve.cli import auto_tier
    from .serve.tokens import TextStream

    check_sampling(args.temperature, args.top_k, args.top_p)   # before anything is printed or loaded
    check_utf8_prompt(args)
    names = tier_names(args.tier)          # the tier-list parser of every verb: " T4" is T4
    if names is None or len(names) != 1:
        what = "every tier" if names is None else "several tiers"
        raise ConfigError(f"{spelled(args, 'tier')} {args.tier!r} names {what}; generate samples from one tier: give "
                          "one ('full', T1..T10, 'auto'; ES-SSM: 8 or K8)")
    args.tier = tier_word(names[0])        # an ES-SSM budget 8 is an int
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tier = auto_tier(args.checkpoint, args) if args.tier == "auto" else args.tier
    model = load_pretrained(args.checkpoint, tier=None if tier == "full" else tier, device=device, dtype=dtype)
    if not hasattr(model, "generate"):
        raise ConfigError(f"{args.checkpoint} holds a {model.arch!r} model, which has no cached generation; generate "
                          "runs ESSH and ES-SSM models")
    tok = resolve_tokenizer(model, args.tokenizer)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise ConfigError(f"{spelled(args, 'prompt')} is empty: give at least one character")
    announce_device("generate", device, dtype)
    g = torch.Generator(device=device).manual_seed(args.seed)
    sys.stdout.write(args.prompt)
    text = TextStream(tok, [])             # the server's decoding: multi-byte characters and subwords survive

    def stream(t: torch.Tensor) -> None:
        sys.stdout.write(text.push(int(t[0])))
        sys.stdout.flush()

    model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   streamer=stream, generator=g, do_sample=args.temperature > 0)
    sys.stdout.write(text.finish() + "\n")
    return 0


def check_utf8_prompt(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the first byte of ``--prompt`` that is not UTF-8 (a lone surrogate, PEP 383)."""
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(args.prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ConfigError(f"{spelled(args, 'prompt')} is not valid UTF-8 text ({what} at character "
                          f"{e.start}); give UTF-8 text, e.g. convert a file from its encoding with --prompt "
                          '"$(iconv -f latin1 -t utf-8 FILE)" (generate has no prompt-file option)') from None


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench_command

    bench_command(overrides(args, "bench"))
    return 0


def bench_main(argv: list[str] | None = None) -> dict:
    """``elastic-ssm bench``'s command line (``--bench.preset 1.5b ...``) in process; returns the results."""
    from .bench import bench_command
    from .cli import parse

    return bench_command(overrides(parse("bench", list(argv or [])), "bench"))


def cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import quickstart

    return _training("quickstart", args, lambda resume, progress: quickstart(
        out_dir=args.out, steps=args.steps, control=args.control, config=args.config, overwrite=args.overwrite,
        resume=resume, progress=progress))
