"""``elastic-ssm prepare`` and ``elastic-ssm tokenizer train``: the data verbs (registered by ``cli.py``)."""

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



def add_data_parsers(sub) -> None:
    """Register ``prepare`` and ``tokenizer`` on the top-level subparsers."""
    s = sub.add_parser("prepare", help="tokenize a corpus into a memory-mapped token file (*.bin + .json)")
    s.add_argument("source", help="'stdlib', a file or folder (txt/jsonl/parquet), or hf:<name>[:cfg][:split]")
    s.add_argument("out", help="output token file, e.g. data/train.bin")
    s.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json")
    s.add_argument("--split", default=None, help="train / validation split of the source (default: all)")
    s.add_argument("--text-field", default="text", help="JSONL/Parquet/HF text field")
    s.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (0: all)")
    s.set_defaults(fn=cmd_prepare)

    s = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = s.add_subparsers(dest="tok_command", required=True, metavar="ACTION")
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer locally")
    t.add_argument("source", help="corpus source (as for prepare)")
    t.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size")
    t.add_argument("--out", required=True, help="output tokenizer.json")
    t.add_argument("--max-bytes", type=int, default=0, help="cap on training text (0: all)")
    t.set_defaults(fn=cmd_tokenizer)
