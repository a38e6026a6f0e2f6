"""lm-evaluation-harness's own command line for elastic models: ``elastic-ssm-lm-eval``.

    elastic-ssm-lm-eval --model elastic-ssm --model_args pretrained=runs/x/final,tier=all \\
        --tasks piqa,hellaswag --batch_size auto --output_path results/ --log_samples

(also ``python -m elastic_ssm.cli_lm_eval``): lm-eval's own ``cli_evaluate`` with our ``ElasticLM`` registered as
``elastic-ssm`` / ``elastic_ssm``, so every lm-eval flag works and results are in lm-eval's format. On top of that:

* ``--model`` defaults to ``elastic-ssm``, ``--device`` to ``cuda`` when a GPU is present, else ``cpu``;
* ``tier=all`` (or ``tier=T1+T4+T10``) in ``--model_args`` runs lm-eval once per tier (ESSH Appendix E.4), each
  into ``<output_path>/<tier>/``; ``tier=T4`` runs one tier, no ``tier`` the model as saved;
* a summary (``tier, K, n_ff, params, task, metric, value, stderr`` rows) is printed and written to ``--csv PATH``
  or ``<output_path>/tiers.csv``; an existing CSV is refused up front unless ``--overwrite``, a file not named
  ``*.csv`` always.

The tokenizer is the one saved with the model. A user's mistake (a bad ``--model_args``, an unknown task) is one line
on stderr and exit code 2; ``--debug`` or ``ELASTIC_SSM_DEBUG=1`` shows the traceback."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from .cli_util import check_replaceable, listed_tier, run_reporting_errors, tier_names, write_csv
from .config import ConfigError

__all__ = ["main"]


def _own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags read here (lm-eval's ``--model``, ``--model_args``, ``--output_path``, ``--device`` with their short
    spellings; our ``--csv`` and ``--overwrite``) and the others, which go to lm-eval as they are."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flags in (("--model", "-M"), ("--model_args", "-a"), ("--output_path", "-o"), ("--device",), ("--csv",)):
        parser.add_argument(*flags)
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_known_args(argv)


def _parse_model_args(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--model_args entry {part!r} is not key=value (e.g. pretrained=DIR,tier=T4)")
        out[key.strip()] = value.strip()
    return out


def _tiers(args: dict[str, str]) -> tuple[list[Any], bool]:
    """The tiers to run (``Tier`` objects; ``[None]`` without ``pretrained=DIR``) and whether ``tier=`` in
    ``--model_args`` is rewritten per run (``tier=all`` or ``tier=A+B``)."""
    spec = args.get("tier", "")
    several = spec == "all" or "+" in spec
    if "pretrained" not in args:
        if several:
            raise ConfigError(f"tier={spec} in --model_args needs pretrained=DIR there too")
        return [None], False
    from .elastic.tiers import resolve_tier, tier_table
    from .models import CheckpointError, saved_model_class

    try:
        config, _ = saved_model_class(args["pretrained"]).read_config(args["pretrained"])
    except CheckpointError as e:
        raise ConfigError(f"--model_args pretrained={args['pretrained']}: {e}") from None
    names = tier_names("full" if spec in ("", "none") else spec.replace("+", ","))     # None: all
    try:
        return tier_table(config) if names is None else [resolve_tier(config, listed_tier(n)) for n in names], several
    except ValueError as e:
        raise ConfigError(f"--model_args tier={spec}: {e}") from None


def _run_lm_eval(argv: list[str], indexes: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """lm-eval's ``cli_evaluate`` on ``argv``: the results dict it computed, or None. ``indexes`` keeps lm-eval's
    task index (a ~10 s scan of every task YAML) between the runs of one invocation, so ``tier=all`` scans once."""
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    from .eval import lm_harness  # noqa: F401  (registers "elastic-ssm" with lm-eval's model registry)

    try:
        from lm_eval.tasks._index import TaskIndex
        descriptor = TaskIndex.__dict__.get("build")
    except ImportError:                   # another lm-eval layout: no reuse, every run scans
        TaskIndex = descriptor = None
    reuse = isinstance(descriptor, staticmethod) and indexes is not None
    captured: dict[str, Any] = {}
    original = lm_eval.simple_evaluate

    def capture(*args: Any, **kwargs: Any) -> Any:
        res = original(*args, **kwargs)
        captured.update({k: v for k, v in (res or {}).items() if k != "samples"})
        return res

    def build(paths: Any, *args: Any, **kwargs: Any) -> Any:
        paths = list(paths)
        key = repr(([str(p) for p in paths], args, sorted(kwargs.items())))
        if key not in indexes:
            indexes[key] = descriptor.__func__(paths, *args, **kwargs)
        return dict(indexes[key])

    saved_argv, sys.argv, lm_eval.simple_evaluate = sys.argv, ["lm-eval", *argv], capture
    if reuse:
        TaskIndex.build = staticmethod(build)
    try:
        cli_evaluate()
    except ValueError as e:
        if str(e).startswith("Tasks not found"):        # lm-eval's own words; say what to do
            raise ConfigError(f"{e}: not a task, group or tag lm-eval knows; check the spelling (`lm-eval list "
                              "tasks` lists them) or pass --include_path DIR with your task YAML files") from None
        raise
    finally:
        sys.argv, lm_eval.simple_evaluate = saved_argv, original
        if reuse:
            TaskIndex.build = descriptor
    return captured or None


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``argv``: ``sys.argv[1:]``); the exit status (2: a user's mistake, in one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)      # --debug: our flag, not lm-eval's
    return run_reporting_errors(lambda: _main([a for a in argv if a != "--debug"]), "lm-eval", "--debug" in argv)


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "run":                   # lm-eval's explicit subcommand: accepted, implied anyway
        argv = argv[1:]
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(__doc__)
        with contextlib.suppress(SystemExit):
            _run_lm_eval(["run", "--help"])
        return 0
    own, argv = _own_flags(argv)
    if own.device is None:
        import torch

        own.device = "cuda" if torch.cuda.is_available() else "cpu"
    own.model = own.model or "elastic-ssm"
    args = _parse_model_args(own.model_args or "") if own.model in ("elastic-ssm", "elastic_ssm") else {}
    csv_path, out_dir, overwrite = own.csv, own.output_path, own.overwrite     # another --model: lm-eval as it is
    rows: list[dict[str, Any]] = []
    from .eval.lm_harness import check_model_args, result_rows

    check_model_args(args)                          # before the model loads: an unknown key is one line
    tiers, rewrite = _tiers(args)
    csv_flag = "--csv" if csv_path else "the summary of --output_path"
    csv_path = csv_path or (str(Path(out_dir) / "tiers.csv") if out_dir and tiers != [None] else None)
    if csv_path:
        check_replaceable(csv_path, overwrite, csv_flag)     # before lm-eval loads the model, not after every task
    indexes: dict[str, Any] = {}
    for tier in tiers:
        model_args, out = own.model_args, out_dir
        if rewrite:
            model_args = ",".join(f"{k}={tier.name if k == 'tier' else v}" for k, v in args.items())
            out = out_dir and str(Path(out_dir) / tier.name)
        run = [*argv, "--model", own.model, "--device", own.device, *(["--model_args", model_args] * bool(model_args)),
               *(["--output_path", out] * bool(out))]
        if tier is not None:
            print(f"[elastic-ssm-lm-eval] tier {tier.name}: K={tier.K}, n_ff={tier.n_ff}, params={tier.params:,}")
        res = _run_lm_eval(["run", *run], indexes)
        if res is not None and tier is not None:
            rows += result_rows(res, tier)
    if rows:
        from .utils.progress import format_table

        print(format_table(rows, ["tier", "params", "task", "metric", "value", "stderr"]))
        if csv_path:
            Path(csv_path).parent.mkdir(parents=True, exist_ok=True)
            write_csv(csv_path, rows, overwrite, csv_flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
