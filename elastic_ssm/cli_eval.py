"""The evaluating verbs (docs/evaluation.md): ``elastic-ssm eval`` (named tiers and capacity fractions, ``--lengths``
sweeps), ``importance`` (ESSH App. L.3, Table 31), ``lm-eval`` (lm-evaluation-harness tasks at every tier) and
``niah`` (needle-in-a-haystack key retrieval, ESSH Tables 17-18)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from . import cli_util
from .cli_util import announce_device, load_model, spelled, status, write_csv
from .config import ConfigError, RunConfig
from .utils.files import atomic_write_text, check_output_path
from .utils.progress import format_table

__all__ = ["cmd_eval", "cmd_importance", "cmd_lm_eval", "cmd_niah", "parse_lengths"]

#: ``--seq_len`` of ``eval`` and ``importance`` when not given (a shorter model's own limit, see ``_lengths``)
DEFAULT_SEQ_LEN = 512


def parse_lengths(spec: str, train_len: int | None) -> list[int]:
    """``--lengths``: comma-separated ``<n>x`` (n times ``train_len``) or absolute token counts."""
    parsed = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        try:
            value = float(item[:-1]) if item.endswith("x") else int(item)
        except ValueError:
            raise ConfigError(f"--lengths {raw!r}: give a multiple of the training length such as 2x, or a "
                              "token count such as 4096") from None
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--lengths {raw!r}: lengths and multiples must be > 0")
        parsed.append((raw, value, item.endswith("x")))
    if train_len is None and any(multiple for _, _, multiple in parsed):
        raise ConfigError(f"--lengths {spec}: no run.yaml found above the model directory to read the training "
                          "length from; give --train_len N or absolute lengths")
    out = [int(round(value * train_len)) if multiple else int(value) for _, value, multiple in parsed]
    if min(out) < 1:
        raise ConfigError(f"--lengths {spec}: every length must be at least one token, got {out}")
    return out


def _tokens_and_bpt(args: argparse.Namespace, model):
    """The held-out token stream of ``--data`` / ``--split`` and the bits-per-byte divisor."""
    from .data import load_corpus
    from .data.tokenizers import resolve_tokenizer
    from .eval.perplexity import measured_bytes_per_token

    tok = resolve_tokenizer(model, args.tokenizer)
    tokens = load_corpus(args.data, tok, split=args.split)
    bpt = args.bytes_per_token
    if not bpt and tok.vocab_size > 260:   # a subword tokenizer: measured on the evaluated text (bytes: 1)
        bpt = measured_bytes_per_token(tok, tokens)
        status(f"bytes per token measured on the evaluation data: {bpt:.4f} (--bytes_per_token overrides)")
    return tokens, bpt or 1.0


def _lengths(args: argparse.Namespace, model) -> list[int]:
    """The sequence lengths scored: ``--lengths`` (eval), else ``--seq_len`` (when not given: 512, or the model's
    longest sequence when shorter: an ES-SSM's filter length); lengths the model does not accept are refused."""
    limit = model.config.max_seq_len()
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit)
        if args.seq_len < DEFAULT_SEQ_LEN:
            status(f"--seq_len {args.seq_len}: the longest sequence this {model.arch} model accepts (the default is "
                   f"{DEFAULT_SEQ_LEN} for longer models)")
    lengths, spec = [args.seq_len], getattr(args, "lengths", None)
    if spec:      # Nx: times --train_len, else train.seq_len of the run.yaml of the run the model directory is in
        runs = [p / "run.yaml" for p in list(Path(args.checkpoint).resolve().parents)[:3] if (p / "run.yaml").is_file()]
        run = None if args.train_len or not runs else runs[0]
        train_len = args.train_len or (run and RunConfig.from_yaml(run).train.seq_len)
        lengths = parse_lengths(spec, train_len)
        if run is not None and any(x.strip().lower().endswith("x") for x in spec.split(",")):
            status(f"training length {train_len} (from {run})")
    if limit is not None and max(lengths) > limit:
        raise ConfigError(f"{'--lengths' if spec else spelled(args, 'seq_len')}: {max(lengths)} tokens exceed this "
                          f"ES-SSM model's filter length {limit}, the longest sequence it accepts")
    return lengths


def cmd_eval(args: argparse.Namespace) -> int:
    from .data import evaluation_batches
    from .eval.perplexity import evaluate_tiers, format_evals, format_length_sweep, split_windows
    from .serve.cli import record_quality

    model, device = load_model(args)
    tiers = cli_util.checked_capacities(model, args.tiers)
    lengths = _lengths(args, model)
    tokens, bpt = _tokens_and_bpt(args, model)
    longest = list(evaluation_batches(tokens, max(lengths), args.batch_size, args.n_batches))
    windows, asked = sum(int(x.shape[0]) for x, _ in longest), args.batch_size * args.n_batches
    if windows < asked:           # a small evaluation set: say so rather than score fewer tokens silently
        status(f"the {args.split} data of {args.data} holds {windows} window(s) of {max(lengths) + 1} tokens, fewer "
               f"than the {asked} asked (--batch_size {args.batch_size} x --n_batches {args.n_batches}): scoring "
               f"{windows * max(lengths):,} tokens")
    batch_sets = [split_windows(longest, n) for n in lengths]    # the same scored tokens at every length
    announce_device("eval", device, next(model.parameters()).dtype)
    rows = [r for batches in batch_sets for r in evaluate_tiers(model, batches, tiers, bytes_per_token=bpt,
                                                                       progress=not args.quiet)]
    print(format_evals(rows))
    if len(lengths) > 1:
        print()
        print(format_length_sweep(rows))
    write_csv(args.csv, [r.row() for r in rows], args.overwrite)
    named = {t.name for t in model.tier_table()}
    recorded = [r for r in rows if r.tier in named and r.seq_len == lengths[0]]   # select_tier picks named tiers
    if recorded:
        record_quality(args, recorded, model, window=max(lengths))
    return 0


def cmd_importance(args: argparse.Namespace) -> int:
    from .eval.importance import has_spectral_channels

    out = Path(args.out) if args.out else Path(args.checkpoint) / "importance"
    check_output_path(spelled(args, "out"), str(out), "folder")     # refused before any work, as earlier results
    cli_util.refuse_existing(args, *(out / f"channel_importance.{x}" for x in ("csv", "json", "png")))  # what it writes
    model, device = load_model(args)
    if not has_spectral_channels(model):
        raise ConfigError(f"{args.checkpoint} holds a {model.arch!r} model: it has no spectral channels; importance "
                          "applies to ESSH and ES-SSM models")
    tier = [None] if args.tier == "full" else cli_util.checked_capacities(model, args.tier, spelled(args, "tier"))
    if tier is None or len(tier) != 1:         # None: --tier all
        raise ConfigError(f"{spelled(args, 'tier')} {args.tier}: give one tier ('full', a name such as T4, or a "
                          "fraction)")
    K = model.resolve_tier(tier and tier[0]).K
    if args.first > K:
        if "first" in args._given:                   # not the default: the user's number
            raise ConfigError(f"{spelled(args, 'first')} {args.first} exceeds the {K} channels of the measured tier; "
                              f"give at most {K}")
        status(f"the measured tier has {K} channels: the first-N share counts all {K} (the default --first is "
               f"{args.first})")
        args.first = K
    _lengths(args, model)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)     # before the work, so an unwritable place fails at once
    try:
        return _importance_into(args, model, tier, out, device)
    except BaseException:
        if created and not any(out.iterdir()):  # a failed run leaves no empty folder behind
            out.rmdir()
        raise


def _importance_into(args: argparse.Namespace, model, tier, out: Path, device) -> int:
    from .data import evaluation_batches
    from .eval.importance import channel_importance, format_importance, plot_importance

    tokens, bpt = _tokens_and_bpt(args, model)
    batches = list(evaluation_batches(tokens, args.seq_len, args.batch_size, args.n_batches))
    announce_device("importance", device, next(model.parameters()).dtype)
    res = channel_importance(model, batches, tier and tier[0], bytes_per_token=bpt, first=args.first,
                             precision=args.precision, progress=not args.quiet)
    print(format_importance(res))
    write_csv(str(out / "channel_importance.csv"), res.rows(), overwrite=True,   # --overwrite was checked first
              flag=spelled(args, "out"))
    clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v   # JSON has no NaN
    record = {"checkpoint": str(args.checkpoint), "data": args.data, "split": args.split, "seq_len": args.seq_len,
              "batches": len(batches), **{k: clean(v) for k, v in res.summary().items()},
              "channels": [{k: clean(v) for k, v in row.items()} for row in res.rows()]}
    atomic_write_text(out / "channel_importance.json", json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / 'channel_importance.json'}")
    skipped = plot_importance(res, out / "channel_importance.png")
    print(f"plot skipped: {skipped}" if skipped else f"wrote {out / 'channel_importance.png'}")
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from .eval.lm_harness import evaluate_tiers_on_tasks
    except ImportError as e:
        raise ConfigError(str(e)) from e

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks is empty: name at least one lm-eval task (e.g. piqa,hellaswag)")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include_path {args.include_path} is not a folder; give the folder of your task YAML "
                          "files")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    names = cli_util.tier_names(args.tiers)
    rows = evaluate_tiers_on_tasks(args.checkpoint, tasks, tiers=names and [cli_util.listed_tier(n) for n in names],
                                   tokenizer=args.tokenizer, device=cli_util.resolve_device(args.device),
                                   batch_size=args.batch_size, max_length=args.max_length, limit=limit,
                                   num_fewshot=args.num_fewshot, include_path=args.include_path,
                                   precision=args.precision, progress=not args.quiet)
    print(format_table(rows, ["tier", "params", "task", "metric", "value", "stderr"]))
    write_csv(args.csv, rows, args.overwrite)
    return 0


def cmd_niah(args: argparse.Namespace) -> int:
    from .data import load_corpus
    from .data.tokenizers import resolve_tokenizer
    from .eval.perplexity import NeedleConfig, build_trials, check_fits, evaluate_needle

    try:               # the other fields are typed options, so a mistake here is in --depths
        cfg = NeedleConfig(context_len=args.context_len, n_pairs=args.n_pairs, condition=args.condition,
                           seed=args.seed, depths=tuple(float(d) for d in args.depths.split(",")),
                           batch_size=args.batch_size)
    except ValueError:
        raise ConfigError(f"{spelled(args, 'depths')} must be comma-separated numbers in [0, 1], got "
                          f"{args.depths!r}") from None
    model, device = load_model(args)
    tok = resolve_tokenizer(model, args.tokenizer)
    filler = load_corpus(args.data, tok, split=args.split)
    tiers = cli_util.checked_tiers(model, args.tiers)
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
