"""Command line: elastic-ssm train|recover|export|eval|importance|generate|serve|bench|quickstart|info|...

tyro derives each verb's flags from its options dataclass (``cli_schema.py``); a mistake is one line, exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from pkgutil import resolve_name
from typing import Any

from . import cli_schema as schema
from . import cli_util as util
from .cli_schema import DEFAULT_RUN
from .config import ConfigError, ModelChoice, RunConfig, model_configs
from .config.base import check_field, field_paths, opt, section
from .utils.files import check_output_path

__all__ = ["COMMANDS", "check_options", "main", "parse"]

#: verb -> (one-line help, options dataclass or None, the module of its ``cmd_<verb>``, imported only when it runs)
COMMANDS: dict[str, tuple[str, type | None, str]] = {
    "info": ("versions, scan backends and device", schema.InfoOptions, "cli_commands"),
    "train": ("train a model from a YAML run file plus --section.field overrides", schema.TrainOptions,
              "cli_commands"),
    "export": ("write standalone tier models and check each against the shared model", schema.ExportOptions,
               "cli_commands"),
    "eval": ("per-tier loss / perplexity / bits-per-byte on a dataset", schema.EvalOptions, "cli_eval"),
    "importance": ("knock-out and output energy per spectral channel (ESSH Table 31)", schema.ImportanceOptions,
                   "cli_eval"),
    "generate": ("sample from any tier, streaming to stdout", schema.GenerateOptions, "cli_commands"),
    "lm-eval": ("lm-evaluation-harness tasks at every tier (needs the eval extra)", schema.LmEvalOptions, "cli_eval"),
    "niah": ("needle-in-a-haystack key retrieval at every tier (ESSH Tables 17-18)", schema.NiahOptions, "cli_eval"),
    "prepare": ("tokenize a corpus into a memory-mapped token file (*.bin + .json)", schema.PrepareOptions,
                "cli_commands"),
    "tokenizer": ("tokenizer tools: `tokenizer train` trains a byte-level BPE tokenizer locally",
                  schema.TokenizerTrainOptions, "cli_commands"),
    "recover": ("truncate a saved ESSH and recover it (dense control, label-only, post-hoc elastification); "
                "tables before/after", schema.RecoverOptions, "cli_commands"),
    "serve": ("OpenAI-compatible HTTP server of every tier of one checkpoint (needs the serve extra)",
              schema.ServeOptions, "serve.cli"),
    "calibrate": ("measure ms/token of every tier on this device (served decode path) into the model directory's "
                  "tier_profile.json", schema.CalibrateOptions, "serve.cli"),
    "bench": ("GPU benchmarks (decode, prefill, generate, train, serve) with peers, or a suite of configs/bench/",
              None, "cli_commands"),
    "quickstart": ("the main job: train a small ESSH on CPU, export, check and evaluate all ten tiers, write "
                   "report.md / tiers.csv / plot", schema.QuickstartOptions, "cli_commands"),
}


def model_flags(run: Any) -> type:
    """The ``--model.*`` flags: a field of the model choice or of any model config (the first class with it gives
    its type and help), defaulting to the run's value (``None`` where its arch lacks it)."""
    choice = {k: v for k, v in run.model_source.items() if k in ("arch", "preset", "tier_config")}
    values = {**{name: getattr(run.model, name) for name in run.model.field_names()}, **ModelChoice(**choice).to_dict()}
    fields, seen = [], set()
    for cls in (ModelChoice, *model_configs().values()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen or not f.init:
                continue
            seen.add(f.name)
            tp, help_ = hints[f.name], f.metadata.get("help", "")
            if f.name not in values:
                tp, help_ = tp | None, help_ + " (default: from the preset of the chosen arch)"
            fields.append((f.name, tp, opt(values.get(f.name), help_)))
    cls = dataclasses.make_dataclass("ModelFlags", fields, kw_only=True)
    cls.__doc__ = ("the model section: arch, preset, tier_config and the fields of every architecture's config (a "
                   "field another arch has is refused)")
    return cls


def run_options(base: type, argv: list[str], model: bool) -> type:
    """``base`` plus the run sections, defaulting to the values of the run file ``--config`` names (``DEFAULT_RUN``)."""
    given = [a.partition("=")[2] if a != "--config" else argv[i + 1] if i + 1 < len(argv) else None
             for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]   # --config F, --config=F
    config = given[0] if given else None
    if len(given) > 1:
        raise ConfigError("--config is given more than once; give one run file (its values are the defaults "
                          "the other flags change)")
    if config is not None and not config.strip():
        raise ConfigError("--config is an empty string; give a run file, or leave it out for the default run")
    run = RunConfig.from_yaml(config or DEFAULT_RUN)
    fields = [(name, type(value), section(lambda v=value: v, help_)) for name, value, help_ in (   # the run's values
        ("train", run.train, "training: recipe, batch, optimizer and recipe sections"),
        ("data", run.data, "where tokens come from"))]
    if model:
        flags = model_flags(run)
        fields.insert(0, ("model", flags, section(flags, "the model")))
    cls = dataclasses.make_dataclass(base.__name__, fields, bases=(base,), kw_only=True)
    cls.__doc__ = f"{base.__doc__} Defaults: {config or DEFAULT_RUN.name + ' (no --config)'}."
    cls.run = run                      # the run file, read once: the verb applies the flags given to it
    return cls


def _prepare(cls: type, argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """``argv`` as tyro reads it, the flag each option was typed with, and the dotted paths given. A repeatable list
    flag given again adds its values; ``--resume`` alone is ``--resume yes``; two spellings of one setting with
    different values are refused. A boolean config field is ``--train.compile`` / ``--train.no_compile``
    (``--no-train.compile``, argparse's spelling, is read too; tyro reads dashes for underscores itself)."""
    paths = field_paths(cls)
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
        base = (head + "." if head else "") + last[3:]           # the field of a negated boolean (no_<field>)
        canonical = base if key not in paths and last.startswith("no_") and base in paths else key
        if canonical not in paths:
            near = [p for p in paths if p.startswith(head + ".") and p.endswith("." + last)] if head else []
            near = near or difflib.get_close_matches(key, [p for p in paths if "." not in p], n=1, cutoff=0.75)
            if near:                         # a flat name (--train.lr) or a near miss (--batches): name the flags
                raise util.CommandLineError(f"unrecognized arguments: {token}; did you mean "
                                            f"{' or '.join('--' + p for p in near)}?")
            out.append([token, *vals])       # tyro names what it does not know
            continue
        if canonical == "resume" and not eq and not vals:
            vals = ["yes"]
        given, rest = ([inline], vals) if eq else (vals, [])
        if canonical in seen and seen[canonical][0] != name and seen[canonical][1] != given:
            old, old_vals = seen[canonical]
            raise ConfigError(f"--{old} {' '.join(old_vals)} and {token} {' '.join(given)} name the same setting; "
                              f"give only --{canonical}")
        seen[canonical], typed[canonical] = (name, given), "--" + name
        if paths[canonical].metadata.get("repeatable") and canonical in merged:
            merged[canonical] += given
            out.append(rest)
        else:
            merged[canonical] = ["--" + key, *given, *rest]
            out.append(merged[canonical])
    return [t for seg in out for t in seg], typed, set(seen)


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    """The options of ``command`` from the tokens after the verb, by tyro: the options' fields plus ``command``,
    ``fn``, ``options_cls``, ``_spelled`` (option -> flag as typed) and ``_given`` (dotted paths given); a rejected
    command line is a ``CommandLineError``. ``train`` / ``recover`` add the run sections, ``bench`` BenchConfig."""
    import tyro
    from tyro._errors import on_parse_error

    help_, cls, module = COMMANDS[command]
    fn = f"elastic_ssm.{module}:cmd_{command.replace('-', '_')}"
    if command in ("train", "recover"):
        cls = run_options(cls, argv, model=command == "train")
    elif command == "bench":
        from .bench import BenchConfig

        bench = ("bench", BenchConfig, section(BenchConfig, "what bench measures and how"))
        cls = dataclasses.make_dataclass("BenchOptions", [bench], kw_only=True)
    prog = "elastic-ssm tokenizer train" if command == "tokenizer" else f"elastic-ssm {command}"
    tokens, typed, given = _prepare(cls, argv)
    with on_parse_error(util.parse_error):
        opts = tyro.cli(cls, args=tokens, prog=prog, description=help_, use_underscores=True)
    ns = argparse.Namespace(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(cls)})
    positional = {f.name: f.metadata["metavar"] for f in dataclasses.fields(cls) if f.metadata.get("metavar")}
    ns.command, ns.fn, ns.options_cls, ns._spelled, ns._given = command, fn, cls, {**positional, **typed}, given
    return ns


def check_options(args: argparse.Namespace) -> None:
    """Before the verb runs: no blank string, the declared types and ranges of the other options (pydantic,
    ``config.base.check_field``), outputs (``flag``'s ``output``) and ``--csv``."""
    cls = args.options_cls
    for f in dataclasses.fields(cls):
        value, flag = getattr(args, f.name, None), util.spelled(args, f.name)
        if dataclasses.is_dataclass(value):
            continue                                   # a config section validates itself
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{flag} is an empty string; give a value (see --help)")
        if not isinstance(value, str):                 # pydantic refuses a str that is not UTF-8, as a path may be
            check_field(cls, f.name, value, flag)
        if f.metadata.get("output") and isinstance(value, str):
            check_output_path(flag, value, f.metadata["output"])
    csv = getattr(args, "csv", None)
    if csv and not Path(csv).resolve().parent.is_dir():       # write_csv creates no folder
        raise ConfigError(f"--csv {csv}: the folder {Path(csv).resolve().parent} does not exist; create it first")
    if csv:                                      # an existing file: refused now, not after the evaluation
        util.check_replaceable(csv, getattr(args, "overwrite", False))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:                     # the top-level --help or --version into `| head`
        if util.stdout_gone():
            return 141
        raise


def _main(argv: list[str]) -> int:
    debug = False
    while argv[:1] == ["--debug"]:
        debug, argv = True, argv[1:]
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"elastic-ssm {__version__}")
        raise SystemExit(0)
    if argv[:1] in (["-h"], ["--help"]):
        width = max(map(len, COMMANDS))
        print("usage: elastic-ssm [--debug] [--version] COMMAND [OPTIONS]\n\n" + __doc__.splitlines()[0] +
              "\n\ncommands (elastic-ssm COMMAND --help lists its flags):\n" +
              "\n".join(f"  {name:<{width}}  {help_}" for name, (help_, _, _) in COMMANDS.items()) +
              "\n\n  --debug    show full tracebacks\n  --version  print the package version and exit")
        return 0
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "tokenizer" and rest[:1] == ["train"]:
        rest = rest[1:]
    elif command == "tokenizer" and rest != ["--help"]:
        what = f"tokenizer {rest[0]}: unknown action" if rest else "tokenizer: no action given"
        util.report(command, f"error: {what}; give `tokenizer train` (see elastic-ssm tokenizer --help)")
        raise SystemExit(2)
    if command not in COMMANDS:
        what = f"unknown command {command!r}" if command else "no command given"
        util.report("", f"error: {what}; give one of {', '.join(COMMANDS)} (see elastic-ssm --help)")
        raise SystemExit(2)

    def run() -> int:
        try:
            args = parse(command, rest)
        except util.CommandLineError as e:
            util.report(command, f"error: {e}")
            raise SystemExit(2) from None
        check_options(args)
        return resolve_name(args.fn)(args)

    return util.run_reporting_errors(run, command, debug)


if __name__ == "__main__":
    sys.exit(main())
