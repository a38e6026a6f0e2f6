"""Command line: ``elastic-ssm train|recover|export|eval|importance|generate|serve|bench|quickstart|info|...``.

The other verbs: ``lm-eval``, ``niah``, ``calibrate``, ``prepare``, ``tokenizer``.

Run flags are derived from the config dataclasses (``--model.<field>``, ``--train.<field>``,
``--data.<field>``; see ``cli_args.py``) on top of a YAML run file (``--config``). Every command prints
``--help``. A user's mistake (a bad flag or value, a missing or unreadable file, a malformed YAML or
tokenizer, a full or read-only disk, diverged training) ends in one line naming the problem and the fix and
exit code 2 (``--debug`` or ``ELASTIC_SSM_DEBUG=1`` shows the traceback); a training run stopped by SIGTERM
or SIGINT exits 128 + the signal number after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from pathlib import Path

from .cli_args import (
    add_dataclass_flags,
    add_device_flag,
    announce_device,
    checked_tiers,
    collect_overrides,
    resolve_device,
    tier_names,
    write_csv,
)
from .cli_errors import Parser, run_reporting_errors
from .config import ConfigError, ESSHConfig, ESSSMConfig
from .data.cli import add_data_parsers
from .eval.cli import TOKENIZER_HELP, add_eval_parsers
from .serve.cli import add_budget_flags, auto_tier
from .serve.cli import add_parsers as add_serve_parsers
from .train.recover_cli import add_recover_parser

DEFAULT_RUN = Path(__file__).resolve().parent / "configs" / "quickstart.yaml"


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
    from .run_config import RunConfig

    base = RunConfig.from_yaml(args.config) if args.config else RunConfig.from_yaml(DEFAULT_RUN)
    model = collect_overrides(args, "model")
    choice = {k: model.pop(k) for k in ("arch", "preset", "tier_config") if k in model}
    base = base.with_model_choice(**choice) if choice else base
    return base.with_overrides(model, collect_overrides(args, "train"), collect_overrides(args, "data"))


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from .pipeline import run_training
    from .train.preflight import TrainingInterrupted

    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --train.out_dir and --overwrite replaces it; give one")
    run = load_run_config(args)
    try:
        run_training(run, resume={None: False, "yes": True}.get(args.resume, args.resume), overwrite=args.overwrite)
    except TrainingInterrupted as e:
        print(f"elastic-ssm train: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.signame, signal.SIGTERM))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .elastic.export import check_export, export_tier
    from .models import load_pretrained

    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    names = checked_tiers(model, args.tier) or [t.name for t in model.tier_table()]
    announce_device("export check", device, next(model.parameters()).dtype)
    tolerance = 0.0 if device == "cpu" else 1e-4   # bitwise on CPU; GPU kernels may pick other reductions
    out = Path(args.out)
    failed = 0
    for name in names:
        small = export_tier(model, name)
        res = check_export(model, name, standalone=small, seq_len=args.check_len, tolerance=tolerance)
        print(res)
        if not res.ok:
            failed += 1
            print(f"  {name}: export check failed; not written")
            continue
        small.save_pretrained(out / name)
    print(f"wrote {len(names) - failed} standalone model(s) under {out}")
    return 1 if failed else 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from .eval.lm_harness import evaluate_tiers_on_tasks
    except ImportError as e:
        raise ConfigError(str(e)) from e
    from .bench.report import format_table

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks is empty: name at least one lm-eval task (e.g. piqa,hellaswag)")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    rows = evaluate_tiers_on_tasks(args.checkpoint, tasks, tiers=tier_names(args.tiers),
                                   tokenizer=args.tokenizer, device=resolve_device(args.device),
                                   batch_size=args.batch_size, max_length=args.max_length, limit=limit,
                                   num_fewshot=args.num_fewshot, include_path=args.include_path,
                                   precision=args.precision)
    print(format_table(rows, ["tier", "params", "task", "metric", "value", "stderr"]))
    write_csv(args.csv, rows)
    return 0


def cmd_niah(args: argparse.Namespace) -> int:
    from .bench.report import format_table
    from .data import load_corpus
    from .data.tokenizer_files import resolve_tokenizer
    from .eval.needle import NeedleConfig, evaluate_needle
    from .models import load_pretrained

    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, device=device)
    tok = resolve_tokenizer(model, args.tokenizer)
    cfg = NeedleConfig(context_len=args.context, n_pairs=args.pairs, condition=args.condition, seed=args.seed,
                       depths=tuple(float(d) for d in args.depths.split(",")), batch_size=args.batch_size)
    filler = load_corpus(args.data, tok, split=args.split)
    tiers = checked_tiers(model, args.tiers)
    announce_device("niah", device, next(model.parameters()).dtype)
    rows = evaluate_needle(model, filler, tok, tiers, cfg, precision=args.precision)
    depth_cols = list(rows[0]["by_depth"])
    flat = [{**{k: v for k, v in r.items() if k != "by_depth"}, **{f"d{d}": v for d, v in r["by_depth"].items()}}
            for r in rows]
    print(format_table(flat, ["tier", "params", "margin_win", "first_token", "full_key", "half_width",
                              *[f"d{d}" for d in depth_cols]],
                       title=f"NIAH, {cfg.n_pairs} key pairs x {len(cfg.depths)} depths, context {cfg.context_len}, "
                             f"{cfg.condition} condition"))
    write_csv(args.csv, flat)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .data.tokenizer_files import resolve_tokenizer
    from .models import load_pretrained
    from .models.generation import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)   # before anything is printed or loaded
    if args.tier.isdigit():  # an ES-SSM budget K
        args.tier = int(args.tier)
    device = resolve_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    tier = auto_tier(args.checkpoint, args) if args.tier == "auto" else args.tier
    model = load_pretrained(args.checkpoint, tier=None if tier == "full" else tier, device=device, dtype=dtype)
    if not hasattr(model, "generate"):
        raise ConfigError(f"{args.checkpoint} holds an {model.arch!r} model; cached generation is an ESSH feature")
    tok = resolve_tokenizer(model, args.tokenizer)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise ConfigError("--prompt is empty: give at least one character")
    announce_device("generate", device, dtype)
    g = torch.Generator(device=device).manual_seed(args.seed)
    sys.stdout.write(args.prompt)

    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def stream(t: torch.Tensor) -> None:
        i = int(t[0])
        if tok.vocab_size <= 260:          # bytes: decode incrementally so multi-byte characters survive
            sys.stdout.write(utf8.decode(bytes([i])) if i < 256 else "")
        else:
            sys.stdout.write(tok.decode([i]))
        sys.stdout.flush()

    model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   streamer=stream, generator=g, do_sample=args.temperature > 0)
    sys.stdout.write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    bench_main(args.bench_args)
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    import signal

    from .quickstart import quickstart
    from .train.preflight import TrainingInterrupted

    try:
        quickstart(out_dir=args.out, steps=args.steps, control=args.control, config=args.config,
                   overwrite=args.overwrite)
    except TrainingInterrupted as e:     # a stopped run, checkpointed: like `train`, not a bug
        print(f"elastic-ssm quickstart: {e}", file=sys.stderr)
        return 128 + int(getattr(signal, e.signame, signal.SIGTERM))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .baseline_config import MatFormerConfig, TransformerConfig
    from .run_config import DataConfig, ModelChoice
    from .train.config import TrainConfig

    p = Parser(prog="elastic-ssm", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="versions, scan backends and device")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("train", help="train a model from a YAML run file plus --section.field overrides")
    s.add_argument("--config", help=f"run YAML (model/train/data sections); default {DEFAULT_RUN.name}")
    s.add_argument("--resume", nargs="?", const="yes", choices=("yes", "auto"), default=None,
                   help="continue from the latest checkpoint in train.out_dir; '--resume auto' starts fresh when "
                        "there is none yet (for jobs requeued with the same command)")
    s.add_argument("--overwrite", action="store_true",
                   help="start fresh in a train.out_dir that holds another run (that run is moved aside)")
    seen = add_dataclass_flags(s, ModelChoice, "model")
    for cls in (ESSHConfig, ESSSMConfig, TransformerConfig, MatFormerConfig):
        seen |= add_dataclass_flags(s, cls, "model", skip=seen)
    add_dataclass_flags(s, TrainConfig, "train")
    add_dataclass_flags(s, DataConfig, "data")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("export", help="write standalone tier models and check each against the shared model")
    s.add_argument("checkpoint", help="model directory (save_pretrained / a run's final/)")
    s.add_argument("--tier", default="all", help="'all' or comma-separated tier names (T1,T4 or K8)")
    s.add_argument("--out", required=True, help="output folder; one sub-folder per tier")
    s.add_argument("--check-len", type=int, default=128, help="tokens per sequence of the export check")
    add_device_flag(s)
    s.set_defaults(fn=cmd_export)

    add_eval_parsers(sub)

    s = sub.add_parser("generate", help="sample from any tier, streaming to stdout")
    s.add_argument("checkpoint", help="model directory")
    s.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    add_device_flag(s)
    s.set_defaults(fn=cmd_generate)
    s.add_argument("--tier", default="full", help="tier to load ('full', T1..T10, 'auto'; ES-SSM: a budget 8 or K8)")
    add_budget_flags(s)
    s.add_argument("--prompt", required=True, help="text to continue")
    s.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample")
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights: auto = bfloat16 on CUDA (the fused decoder's format), float32 on CPU")

    s = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks at every tier (needs the eval extra)")
    s.add_argument("checkpoint", help="model directory")
    s.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (piqa,hellaswag,...)")
    s.add_argument("--tiers", default="all", help="'all' or comma-separated tier names")
    s.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    add_device_flag(s)
    s.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    s.add_argument("--max-length", type=int, default=2048, help="longest scored input in tokens")
    s.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    s.add_argument("--limit", type=float, default=None,
                   help="documents per task (>= 1) or a fraction (< 1): a smoke run, not a paper number")
    s.add_argument("--include-path", default=None, help="folder of extra task YAML files (local tasks)")
    s.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16 = autocast")
    s.add_argument("--csv", help="also write the rows as CSV")
    s.set_defaults(fn=cmd_lm_eval)

    s = sub.add_parser("niah", help="needle-in-a-haystack key retrieval at every tier (ESSH Tables 17-18)")
    s.add_argument("checkpoint", help="model directory")
    s.add_argument("--tiers", default="all", help="'all' or comma-separated tier names")
    s.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    s.add_argument("--data", default="stdlib", help="filler text source (as for eval)")
    s.add_argument("--split", default="validation", help="split of the filler source")
    s.add_argument("--context", type=int, default=2048, help="tokens per trial before the answer")
    s.add_argument("--pairs", type=int, default=256, help="key pairs (each runs at every depth)")
    s.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="relative needle depths")
    s.add_argument("--condition", default="counterfactual", choices=("counterfactual", "planted"),
                   help="which key of a pair is inserted and expected (the paper's tables: counterfactual)")
    s.add_argument("--seed", type=int, default=0, help="keys, filler windows and bootstrap")
    s.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    add_device_flag(s)
    s.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16 = autocast")
    s.add_argument("--csv", help="also write the rows as CSV")
    s.set_defaults(fn=cmd_niah)

    add_data_parsers(sub)
    add_recover_parser(sub)

    add_serve_parsers(sub)

    s = sub.add_parser("bench", help="GPU benchmarks (decode, prefill, training, memory) with peers",
                       add_help=False)
    s.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark harness (--help)")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("quickstart", help="the main job: train a small ESSH on CPU, export, check and "
                                          "evaluate all ten tiers, write report.md / tiers.csv / plot")
    s.add_argument("--out", default="runs/quickstart", help="output folder")
    s.add_argument("--steps", type=int, default=0, help="override the training steps (0: config default)")
    s.add_argument("--config", default=None, help="run YAML (default: the embedded quickstart config)")
    s.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the dense control (full capacity only) and truncate it to T1")
    s.add_argument("--overwrite", action="store_true", help="move the runs of an earlier quickstart in --out aside")
    s.set_defaults(fn=cmd_quickstart)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is not None and argv[command] == "bench":
        # everything after "bench" belongs to the harness's own parser (its flags start with "-", which an
        # argparse REMAINDER positional does not take when they come first)
        args = parser.parse_args(argv[:command + 1])
        args.bench_args = argv[command + 1:]
    else:
        args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("ELASTIC_SSM_DEBUG", "") not in ("", "0")
    return run_reporting_errors(lambda: args.fn(args), args, debug)


if __name__ == "__main__":
    sys.exit(main())
