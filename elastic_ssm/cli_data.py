"""``elastic-ssm prepare`` (under a one-writer lock on its output; docs/data.md) and ``elastic-ssm tokenizer train``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_util import refuse_existing
from .utils.files import is_temp_name
from .utils.progress import shown


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove the temporary files an interrupted ``prepare`` of ``out`` left (call it holding the lock)."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for p in sorted(out.parent.iterdir()):
        if p.is_file() and is_temp_name(p.name) and p.name.startswith(f".{out.name}."):
            p.unlink(missing_ok=True)
            print(f"[prepare] removed {p} (temporary file of an interrupted prepare of {out.name})", file=sys.stderr)
            removed.append(p)
    return removed


def cmd_prepare(args: argparse.Namespace) -> int:
    from .data import prepare
    from .data.tokenfile import sidecar_path
    from .train.rundir import RunLock

    out = Path(args.out)
    if out.suffix != ".bin":      # another name is refused by prepare, before any work, whether it exists or not
        return _prepare(args, prepare)
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]   # the folders the lock creates
    lock = RunLock(out.parent, owner=f"prepare writing {out.name}", flag="OUT", name=f".{out.name}.lock")
    had_lock = lock.path.exists()
    lock.acquire()
    ok = False
    try:
        clean_stale_temps(out)
        refuse_existing(args, out, sidecar_path(out))      # the tokens and their .json sidecar are one output
        rc = _prepare(args, prepare)
        ok = True
        return rc
    finally:      # its own lock file goes (removed while still held); a refused prepare leaves no folder either
        if not had_lock:
            lock.path.unlink(missing_ok=True)
        lock.release()
        for folder in [] if ok else made:
            try:
                folder.rmdir()
            except OSError:
                break


def _prepare(args: argparse.Namespace, prepare) -> int:
    tf = prepare(args.source, args.out, args.tokenizer, split=args.split, text_field=args.text_field,
                 max_tokens=args.max_tokens or None, show_progress=not args.quiet)
    print(f"wrote {len(tf):,} tokens to {args.out}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from .data import train_bpe

    refuse_existing(args, Path(args.out))
    tok = train_bpe(args.source, args.vocab_size, args.out, max_bytes=args.max_bytes or None,
                    show_progress=shown(not args.quiet))
    print(f"trained a {tok.vocab_size}-entry BPE tokenizer -> {args.out}")
    return 0
