"""``elastic-ssm prepare`` and ``elastic-ssm tokenizer train``: the data verbs (registered by ``cli.py``; their flags
are ``PrepareOptions`` / ``TokenizerTrainOptions`` of ``cli_options.py``)."""

from __future__ import annotations

import argparse


def cmd_prepare(args: argparse.Namespace) -> int:
    from . import prepare

    tf = prepare(args.source, args.out, args.tokenizer, split=args.split, text_field=args.text_field,
                 max_tokens=args.max_tokens or None)
    print(f"wrote {len(tf):,} tokens to {args.out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from . import train_bpe

    tok = train_bpe(args.source, args.vocab_size, args.out, max_bytes=args.max_bytes or None, show_progress=True)
    print(f"trained a {tok.vocab_size}-entry BPE tokenizer -> {args.out}")
    return 0
