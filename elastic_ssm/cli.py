"""Command line: elastic-ssm train|recover|export|eval|importance|generate|serve|bench|quickstart|info|...

tyro derives each verb's flags from its options dataclass (``cli_schema.py``); a mistake is one line, exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path
from typing import Any

from . import cli_schema as schema
from .cli_errors import CommandLineError, debug_requested, parse_error, report, run_reporting_errors
from .cli_schema import DEFAULT_RUN
from .cli_util import check_csv_target, check_output_path, find_flag, spelled
from .config import ConfigError

__all__ = ["COMMANDS", "check_options", "main", "parse"]

#: verb -> (one-line help, options dataclass or None, "module:function" imported only when the verb runs)
COMMANDS: dict[str, tuple[str, type | None, str]] = {
    "info": ("versions, scan backends and device", None, "elastic_ssm.cli_commands:cmd_info"),
    "train": ("train a model from a YAML run file plus --section.field overrides", schema.TrainOptions,
              "elastic_ssm.cli_commands:cmd_train"),
    "export": ("write standalone tier models and check each against the shared model", schema.ExportOptions,
               "elastic_ssm.cli_commands:cmd_export"),
    "eval": ("per-tier loss / perplexity / bits-per-byte on a dataset", schema.EvalOptions,
             "elastic_ssm.cli_eval:cmd_eval"),
    "importance": ("knock-out and output energy per spectral channel (ESSH Table 31)", schema.ImportanceOptions,
                   "elastic_ssm.cli_eval:cmd_importance"),
    "generate": ("sample from any tier, streaming to stdout", schema.GenerateOptions,
                 "elastic_ssm.cli_commands:cmd_generate"),
    "lm-eval": ("lm-evaluation-harness tasks at every tier (needs the eval extra)", schema.LmEvalOptions,
                "elastic_ssm.cli_commands:cmd_lm_eval"),
    "niah": ("needle-in-a-haystack key retrieval at every tier (ESSH Tables 17-18)", schema.NiahOptions,
             "elastic_ssm.cli_commands:cmd_niah"),
    "prepare": ("tokenize a corpus into a memory-mapped token file (*.bin + .json)", schema.PrepareOptions,
                "elastic_ssm.cli_data:cmd_prepare"),
    "tokenizer": ("tokenizer tools: `tokenizer train` trains a byte-level BPE tokenizer locally",
                  schema.TokenizerTrainOptions, "elastic_ssm.cli_data:cmd_tokenizer"),
    "recover": ("truncate a saved ESSH and recover it (dense control, label-only, post-hoc elastification); "
                "tables before/after", schema.RecoverOptions, "elastic_ssm.cli_recover:cmd_recover"),
    "serve": ("OpenAI-compatible HTTP server of every tier of one checkpoint (needs the serve extra)",
              schema.ServeOptions, "elastic_ssm.serve.cli:cmd_serve"),
    "calibrate": ("measure ms/token of every tier on this device (served decode path) into the model directory's "
                  "tier_profile.json", schema.CalibrateOptions, "elastic_ssm.serve.cli:cmd_calibrate"),
    "bench": ("GPU benchmarks (decode, prefill, training, memory) with peers, or a suite of configs/bench/", None,
              "elastic_ssm.cli_commands:cmd_bench"),
    "quickstart": ("the main job: train a small ESSH on CPU, export, check and evaluate all ten tiers, write "
                   "report.md / tiers.csv / plot", schema.QuickstartOptions, "elastic_ssm.cli_commands:cmd_quickstart"),
}
_MODEL_CLASSES = ("ModelChoice", "ESSHConfig", "ESSSMConfig", "TransformerConfig", "MatFormerConfig")


def _section(name: str, cls: type, value: Any, help_: str) -> tuple[str, type, Any]:
    """A field ``name`` of a derived options class: the config section ``value`` (its flags' defaults)."""
    return (name, cls, dataclasses.field(default_factory=lambda: value, metadata={"help": help_}))


def model_flags(run: Any) -> tuple[type, Any]:
    """The ``--model.*`` flags: a field of the model choice or of any model config (the first class with it gives
    its type and help), defaulting to the run's value (``None`` where its arch lacks it)."""
    from . import config

    choice = {k: v for k, v in run.model_source.items() if k in ("arch", "preset", "tier_config")}
    values = {**{name: getattr(run.model, name) for name in run.model.field_names()},
              **config.ModelChoice(**choice).to_dict()}
    fields, seen = [], set()
    for cls in (getattr(config, name) for name in _MODEL_CLASSES):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen or not f.init:
                continue
            seen.add(f.name)
            tp, help_ = hints[f.name], f.metadata.get("help", "")
            if f.name not in values:
                tp, help_ = tp | None, help_ + " (default: from the preset of the chosen arch)"
            fields.append((f.name, tp, dataclasses.field(default=values.get(f.name), metadata={"help": help_})))
    cls = dataclasses.make_dataclass("ModelFlags", fields, kw_only=True)
    cls.__doc__ = ("the model section: arch, preset, tier_config and the fields of every architecture's config (a "
                   "field another arch has is refused)")
    return cls, cls()


def run_options(base: type, argv: list[str], model: bool) -> type:
    """``base`` plus the run sections, defaulting to the values of the run file ``--config`` names (``DEFAULT_RUN``)."""
    from .config import RunConfig

    config = find_flag(argv, ("--config",))[1]
    if config is not None and not config.strip():
        raise ConfigError("--config is an empty string; give a run file, or leave it out for the default run")
    run = RunConfig.from_yaml(config or DEFAULT_RUN)
    fields = [_section("train", type(run.train), run.train, "training: recipe, batch, optimizer and recipe sections"),
              _section("data", type(run.data), run.data, "where tokens come from")]
    if model:
        fields.insert(0, _section("model", *model_flags(run), "the model"))
    cls = dataclasses.make_dataclass(base.__name__, fields, bases=(base,), kw_only=True)
    cls.__doc__ = f"{base.__doc__} Defaults: {config or DEFAULT_RUN.name + ' (no --config)'}."
    return cls


def bench_options() -> type:
    """``bench``: the ``BenchConfig`` fields as ``--bench.<field>``."""
    from .bench import BenchConfig

    return dataclasses.make_dataclass("BenchOptions", [_section("bench", BenchConfig, BenchConfig(),
                                                                "what bench measures and how")], kw_only=True)


def options_class(command: str, argv: list[str]) -> type | None:
    cls = COMMANDS[command][1]
    if command in ("train", "recover"):
        return run_options(cls, argv, model=command == "train")
    return bench_options() if command == "bench" else cls


def _flag_table(cls: type, prefix: str = "") -> dict[str, Any]:
    """The dotted paths of ``cls``'s flags -> their field."""
    hints = typing.get_type_hints(cls)
    paths = {}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            paths.update(_flag_table(tp, f"{prefix}{f.name}."))
        else:
            paths[prefix + f.name] = f
    return paths


def _prepare(cls: type, argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """``argv`` as tyro reads it, the flag each option was typed with, and the dotted paths given. A repeatable list
    flag given again adds its values; ``--resume`` alone is ``--resume yes``; two spellings of one setting with
    different values are refused. A boolean config field is
    ``--train.compile`` / ``--train.no_compile`` (``--no-train.compile``, argparse's spelling, is read too)."""
    paths = _flag_table(cls)
    segments: list[list[str]] = [[]]
    for token in argv:
        if token.startswith("--") and token not in ("--help", "--"):
            segments.append([token])
        else:
            segments[-1].append(token)
    out, typed, seen, merged = [segments[0]], {}, {}, {}
    for token, *vals in segments[1:]:
        name, eq, inline = token[2:].partition("=")
        key = name.replace("-", "_")
        if key.startswith("no_") and "." in key and key[3:] in paths:    # argparse's --no-train.compile
            key = "{0}.no_{2}".format(*key[3:].rpartition("."))
        head, _, last = key.rpartition(".")
        negated = key not in paths and last.startswith("no_") and (head + "." if head else "") + last[3:] in paths
        canonical = (head + "." if head else "") + last[3:] if negated else key
        if canonical not in paths:
            near = [p for p in paths if p.startswith(head + ".") and p.endswith("." + last)] if head else []
            near = near or difflib.get_close_matches(key, [p for p in paths if "." not in p], n=1, cutoff=0.75)
            if near:                         # a flat name (--train.lr) or a near miss (--batches): name the flags
                raise CommandLineError(f"unrecognized arguments: {token}; did you mean "
                                       f"{' or '.join('--' + p for p in near)}?")
            out.append([token, *vals])       # tyro names what it does not know
            continue
        field = paths[canonical]
        if canonical == "resume" and not eq and not vals:
            vals = ["yes"]
        given = [inline] if eq else vals
        if canonical in seen and seen[canonical][0] != name and seen[canonical][1] != given:
            old, old_vals = seen[canonical]
            raise ConfigError(f"--{old} {' '.join(old_vals)} and {token} {' '.join(given)} name the same setting; "
                              f"give only --{canonical}")
        seen[canonical], typed[canonical] = (name, given), "--" + name
        if field.metadata.get("repeatable") and canonical in merged:
            merged[canonical] += given
            out.append(vals if eq else [])
            continue
        flag = "--" + ((head + "." if head else "") + "no_" + last[3:] if negated else canonical)
        out.append([flag, *given] if not eq else [flag, inline, *vals])
        merged[canonical] = out[-1]
    return [t for seg in out for t in seg], typed, set(seen)


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    """The options of ``command`` from the tokens after the verb, by tyro: the options' fields plus ``command``,
    ``fn``, ``options_cls``, ``_spelled`` (option -> flag as typed) and ``_given`` (dotted paths given); a rejected
    command line is a ``CommandLineError``."""
    import tyro
    from tyro._errors import on_parse_error

    help_, _, fn = COMMANDS[command]
    cls = options_class(command, argv)
    prog = "elastic-ssm tokenizer train" if command == "tokenizer" else f"elastic-ssm {command}"
    if cls is None:
        if argv and argv != ["--help"]:
            raise CommandLineError(f"unrecognized arguments: {' '.join(argv)} (see {prog} --help)")
        if argv:
            print(f"usage: {prog}\n\n{help_}")
            raise SystemExit(0)
        return argparse.Namespace(command=command, fn=fn, options_cls=None, _spelled={}, _given=set())
    tokens, typed, given = _prepare(cls, argv)
    with on_parse_error(parse_error):
        opts = tyro.cli(cls, args=tokens, prog=prog, description=help_, use_underscores=True)
    ns = argparse.Namespace(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(cls)})
    positional = {f.name: f.metadata["metavar"] for f in dataclasses.fields(cls) if f.metadata.get("metavar")}
    ns.command, ns.fn, ns.options_cls, ns._spelled, ns._given = command, fn, cls, {**positional, **typed}, given
    return ns


def check_options(args: argparse.Namespace) -> None:
    """What the options' types cannot say (``flag`` metadata, ``--csv``, ``--depths``), before the verb runs."""
    cls = args.options_cls
    for f in dataclasses.fields(cls) if cls is not None else ():
        meta, value = f.metadata, getattr(args, f.name, None)
        if dataclasses.is_dataclass(value):
            continue                                   # a config section validates itself
        items = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(v, str) and not v.strip() for v in items):
            raise ConfigError(f"{spelled(args, f.name)} is an empty string; give a value (see --help)")
        numbers = [v for v in items if isinstance(v, int | float) and not isinstance(v, bool)]
        if any(not math.isfinite(v) for v in numbers):
            raise ConfigError(f"{spelled(args, f.name)} must be a finite number, got {value}")
        for key, bad, words in (("minimum", lambda v, b: v < b, ">="), ("above", lambda v, b: v <= b, ">"),
                                ("maximum", lambda v, b: v > b, "<=")):
            bound = meta.get(key)
            if bound is not None and any(bad(v, bound) for v in numbers):
                raise ConfigError(f"{spelled(args, f.name)} must be {words} {bound}, got {value}")
        if meta.get("output") and isinstance(value, str):
            check_output_path(spelled(args, f.name), value, meta["output"])
    csv = getattr(args, "csv", None)             # write_csv creates no folder
    if csv and not Path(csv).resolve().parent.is_dir():
        raise ConfigError(f"--csv {csv}: the folder {Path(csv).resolve().parent} does not exist; create it first")
    if csv:                                      # an existing file: refused now, not after the evaluation
        check_csv_target(csv, getattr(args, "overwrite", False))
    bpt = getattr(args, "bytes_per_token", None)
    if bpt is not None and not (math.isfinite(bpt) and bpt >= 0):
        raise ConfigError(f"{spelled(args, 'bytes_per_token')} must be a finite number >= 0 (0: automatic), got {bpt}")
    depths = getattr(args, "depths", None)
    if isinstance(depths, str):
        try:
            values = [float(d) for d in depths.split(",")]
        except ValueError:
            values = []
        if not values or not all(0 <= d <= 1 for d in values):   # also NaN
            raise ConfigError(f"--depths must be comma-separated numbers in [0, 1], got {depths!r}")


def _overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (help_, _, _) in COMMANDS.items()]
    return ("usage: elastic-ssm [--debug] [--version] COMMAND [OPTIONS]\n\n" + __doc__.splitlines()[0] +
            "\n\ncommands (elastic-ssm COMMAND --help lists its flags):\n" + "\n".join(lines) +
            "\n\n  --debug    show full tracebacks\n  --version  print the package version and exit")


def _fn(spec: str):
    """``"module:function"`` -> the function."""
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug_flag = False
    while argv and argv[0] == "--debug":
        debug_flag, argv = True, argv[1:]
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"elastic-ssm {__version__}")
        raise SystemExit(0)
    command = argv[0] if argv else ""
    reporter = argparse.Namespace(command=command or "")
    if command in ("-h", "--help"):
        print(_overview())
        return 0
    rest = argv[1:]
    if command == "tokenizer" and rest[:1] == ["train"]:
        rest = rest[1:]
    elif command == "tokenizer" and rest != ["--help"]:
        what = f"tokenizer {rest[0]}: unknown action" if rest else "tokenizer: no action given"
        report(reporter, f"error: {what}; give `tokenizer train` (see elastic-ssm tokenizer --help)")
        raise SystemExit(2)
    if command not in COMMANDS:
        what = f"unknown command {command!r}" if command else "no command given"
        report(argparse.Namespace(command=""), f"error: {what}; give one of {', '.join(COMMANDS)} (see "
                                               "elastic-ssm --help)")
        raise SystemExit(2)
    debug = debug_requested(debug_flag, reporter)
    if debug is None:
        return 2

    def run() -> int:
        try:
            args = parse(command, rest)
        except CommandLineError as e:
            report(reporter, f"error: {e}")
            raise SystemExit(2) from None
        check_options(args)
        return _fn(args.fn)(args)

    if debug:
        return run_reporting_errors(run, reporter, debug)
    import warnings

    original = warnings.formatwarning    # a warning is one line too (no source line); --debug shows the usual form
    warnings.formatwarning = lambda message, category, *rest, **kw: (
        f"elastic-ssm {command}: {category.__name__}: {' '.join(str(message).split())}\n")
    try:
        return run_reporting_errors(run, reporter, debug)
    finally:
        warnings.formatwarning = original


if __name__ == "__main__":
    sys.exit(main())
