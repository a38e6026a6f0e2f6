"""``elastic-ssm prepare`` and ``elastic-ssm tokenizer train``: the data verbs (registered by ``cli.py``; their flags
are ``PrepareOptions`` / ``TokenizerTrainOptions`` of ``cli_schema.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_util import refuse_existing


def cmd_prepare(args: argparse.Namespace) -> int:
    from . import prepare
    from .tokenfile import sidecar_path

    out = Path(args.out)
    if out.suffix == ".bin":      # another name is refused by prepare, before any work, whether it exists or not
        refuse_existing(args, out, sidecar_path(out))      # the tokens and their .json sidecar are one output
    tf = prepare(args.source, args.out, args.tokenizer, split=args.split, text_field=args.text_field,
                 max_tokens=args.max_tokens or None, show_progress=not args.quiet)
    print(f"wrote {len(tf):,} tokens to {args.out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from . import train_bpe

    refuse_existing(args, Path(args.out))
    tok = train_bpe(args.source, args.vocab_size, args.out, max_bytes=args.max_bytes or None, show_progress=True)
    print(f"trained a {tok.vocab_size}-entry BPE tokenizer -> {args.out}")
    return 0
