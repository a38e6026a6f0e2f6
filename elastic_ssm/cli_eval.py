"""``elastic-ssm eval`` (named tiers and capacity fractions, ``--lengths`` sweeps) and ``elastic-ssm importance``
(ESSH App. L.3, Table 31); docs/evaluation.md."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .cli_util import announce_device, checked_capacities, refuse_existing, resolve_device, spelled, status, write_csv
from .config import ConfigError
from .utils.files import atomic_write_text

__all__ = ["DEFAULT_SEQ_LEN", "cmd_eval", "cmd_importance", "parse_lengths", "training_length"]

#: ``--seq_len`` of ``eval`` and ``importance`` when not given (a shorter model's own limit, see ``_default_seq_len``)
DEFAULT_SEQ_LEN = 512


def training_length(checkpoint: str | Path) -> tuple[int, Path] | None:
    """``(train.seq_len, run.yaml)`` of the run a model directory (or checkpoint) is in, or None."""
    from .config import RunConfig

    here = Path(checkpoint).resolve()
    for parent in list(here.parents)[:3]:
        run = parent / "run.yaml"
        if run.is_file():
            return RunConfig.from_yaml(run).train.seq_len, run
    return None


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
    from .data.tokenizer_files import resolve_tokenizer
    from .data.tokenizers import measured_bytes_per_token

    tok = resolve_tokenizer(model, args.tokenizer)
    tokens = load_corpus(args.data, tok, split=args.split)
    bpt = args.bytes_per_token
    if not bpt:   # the byte tokenizer: 1; a subword tokenizer: measured on the evaluated text
        bpt = 1.0 if tok.vocab_size <= 260 else measured_bytes_per_token(tok, tokens)
        if tok.vocab_size > 260:
            status(f"bytes per token measured on the evaluation data: {bpt:.4f} (--bytes_per_token overrides)")
    return tokens, bpt


def _default_seq_len(args: argparse.Namespace, model) -> None:
    """``--seq_len`` when not given: 512, or the model's longest sequence when shorter (an ES-SSM's filter length)."""
    if args.seq_len is not None:
        return
    limit = model.config.max_seq_len()
    args.seq_len = DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit)
    if args.seq_len < DEFAULT_SEQ_LEN:
        status(f"--seq_len {args.seq_len}: the longest sequence this {model.arch} model accepts (the default is "
               f"{DEFAULT_SEQ_LEN} for longer models)")


def _check_length(model, longest: int, which: str) -> None:
    """Refuse sequences of ``longest`` tokens that the model does not accept (an ES-SSM: its filter length)."""
    limit = model.config.max_seq_len()
    if limit is not None and longest > limit:
        raise ConfigError(f"{which}: {longest} tokens exceed this ES-SSM model's filter length {limit}, the longest "
                          "sequence it accepts")


def cmd_eval(args: argparse.Namespace) -> int:
    from .data import evaluation_batches
    from .eval.perplexity import evaluate_tiers, format_evals, format_length_sweep, split_windows
    from .models import load_pretrained
    from .serve.cli import record_quality

    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    tiers = checked_capacities(model, args.tiers)
    _default_seq_len(args, model)
    lengths = [args.seq_len]
    if args.lengths:
        found = (args.train_len, None) if args.train_len else training_length(args.checkpoint)
        lengths = parse_lengths(args.lengths, found and found[0])
        if found and found[1] is not None and any(x.strip().lower().endswith("x") for x in args.lengths.split(",")):
            status(f"training length {found[0]} (from {found[1]})")
    _check_length(model, max(lengths), "--lengths" if args.lengths else spelled(args, "seq_len"))
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


#: what ``importance`` writes into its ``--out`` folder
IMPORTANCE_FILES = ("channel_importance.csv", "channel_importance.json", "channel_importance.png")


def _importance_folder(args: argparse.Namespace) -> Path:
    """``--out`` (``MODEL_DIR/importance``), refused before any work when it is a file or holds earlier results."""
    out = Path(args.out) if args.out else Path(args.checkpoint) / "importance"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{spelled(args, 'out')} {out} is a file; give a folder")
    refuse_existing(args, *(out / name for name in IMPORTANCE_FILES))
    return out


def cmd_importance(args: argparse.Namespace) -> int:
    from .cli_schema import ImportanceOptions
    from .eval.importance import has_spectral_channels
    from .models import load_pretrained

    out = _importance_folder(args)
    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    if not has_spectral_channels(model):
        raise ConfigError(f"{args.checkpoint} holds a {model.arch!r} model: it has no spectral channels; importance "
                          "applies to ESSH and ES-SSM models")
    tier = None if args.tier == "full" else checked_capacities(model, args.tier, spelled(args, "tier"))
    if tier is not None and len(tier) != 1:
        raise ConfigError(f"{spelled(args, 'tier')} {args.tier}: give one tier ('full', a name such as T4, or a "
                          "fraction)")
    K = model.resolve_tier(tier and tier[0]).K
    if args.first > K:
        if args.first != ImportanceOptions.first:       # the option's default
            raise ConfigError(f"{spelled(args, 'first')} {args.first} exceeds the {K} channels of the measured tier; "
                              f"give at most {K}")
        status(f"the measured tier has {K} channels: the first-N share counts all {K} (the default --first is "
               f"{args.first})")
        args.first = K
    _default_seq_len(args, model)
    _check_length(model, args.seq_len, spelled(args, "seq_len"))
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
