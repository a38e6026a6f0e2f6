"""ES-SSM decoding report: filter-fit error and bits-per-byte change of the modal decoder against exact decoding.

For a trained ES-SSM byte LM directory (e.g. the final model of
``elastic-ssm train --config configs/es-ssm-decode-cpu.yaml``) this scores held-out windows of the
embedded stdlib corpus through prefill + ``ESSSM.step`` (``eval/decode_bpb.py``) with the exact ring-buffer
decoder and with the modal decoder at m in {4, 8, 16}, at each budget, and prints a markdown table with
the command, commit and date (the numbers of ``docs/results.md``). CPU, float32.

    python scripts/es_ssm_decode_report.py runs/es-ssm-decode-cpu/final --windows 32 --budgets 2,8,16
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import torch


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "diff-index", "--quiet", "HEAD", "--"]).returncode != 0
    return out.stdout.strip() + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="ES-SSM model directory (save_pretrained)")
    p.add_argument("--windows", type=int, default=32, help="held-out windows of L tokens")
    p.add_argument("--budgets", default="", help="comma-separated budgets K (default: the model's budgets)")
    p.add_argument("--modes", default="4,8,16", help="comma-separated m of the modal decoder")
    p.add_argument("--prefill", type=int, default=1, help="tokens prefilled before stepping")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from elastic_ssm.data import evaluation_batches, load_corpus
    from elastic_ssm.eval.decode_bpb import format_modal_report, modal_report
    from elastic_ssm.models import load_pretrained

    model = load_pretrained(args.model).eval()
    cfg = model.config
    L = cfg.seq_len
    held = load_corpus("stdlib", "bytes", split="validation")
    batch = next(iter(evaluation_batches(held, L, args.windows, 1)))[0]  # [N, L], spread over the split
    budgets = [int(k) for k in args.budgets.split(",")] if args.budgets else list(cfg.budgets)
    modes = [int(m) for m in args.modes.split(",")]
    t0 = time.time()
    rows = modal_report(model, batch, budgets, modes, prefill=args.prefill)
    table = format_modal_report(rows)
    head = (f"model `{args.model}` (d={cfg.d_model}, {cfg.n_layers} blocks, K-bar={cfg.n_channels}, L={L}); "
            f"{batch.shape[0]} held-out stdlib windows of {L} bytes, {rows[0]['tokens']:,} scored tokens each; "
            f"commit `{_commit()}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"torch {torch.__version__} CPU fp32, {time.time() - t0:.0f} s\n"
            f"command: `python {' '.join(sys.argv)}`\n")
    text = head + "\n" + table
    print(text)
    return text


if __name__ == "__main__":
    main()
