"""``elastic-ssm prepare`` and ``elastic-ssm tokenizer train``: the data verbs (registered by ``cli.py``; their flags
are ``PrepareOptions`` / ``TokenizerTrainOptions`` of ``cli_options.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def refuse_existing(args: argparse.Namespace, *paths: Path) -> None:
    """A one-line ``ConfigError`` when one of ``paths`` (the command's output ``args.out`` and its companions) exists
    and ``--overwrite`` was not given: what a user saved is never replaced silently."""
    from ..cli_args import spelled
    from ..config import ConfigError

    found = [p for p in paths if p.exists()]
    if found and not args.overwrite:
        also = f" (and {', '.join(str(p) for p in found[1:])})" if len(found) > 1 else ""
        raise ConfigError(f"{spelled(args, 'out')} {found[0]} already exists{also}; pass --overwrite to replace "
                          f"{'them' if also else 'it'}, or choose another output path")


def cmd_prepare(args: argparse.Namespace) -> int:
    from . import prepare
    from .tokenfile import sidecar_path

    out = Path(args.out)
    if out.suffix == ".bin":      # another name is refused by prepare, before any work, whether it exists or not
        refuse_existing(args, out, sidecar_path(out))      # the tokens and their .json sidecar are one output
    tf = prepare(args.source, args.out, args.tokenizer, split=args.split, text_field=args.text_field,
                 max_tokens=args.max_tokens or None)
    print(f"wrote {len(tf):,} tokens to {args.out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from . import train_bpe

    refuse_existing(args, Path(args.out))
    tok = train_bpe(args.source, args.vocab_size, args.out, max_bytes=args.max_bytes or None, show_progress=True)
    print(f"trained a {tok.vocab_size}-entry BPE tokenizer -> {args.out}")
    return 0
