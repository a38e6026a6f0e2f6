"""Bench suites: YAML files under ``configs/bench/`` of typed entries (``kinds.py``), with targets as data
(``targets.py``) and a time budget (docs/performance.md, "Suites"). ``load_suite`` validates a suite with one-line
errors before anything runs; ``run_suite`` runs its entries in order, each into ``OUT_DIR/<entry>/``;
``suite_command`` is ``elastic-ssm bench --bench.suite`` (``elastic_ssm.bench.bench_command`` loads this module from
a clone through ``elastic_ssm.bench.harness_module``)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.kinds import KINDS, kind_options, kind_runner
from benchmarks.suite_report import suite_markdown, suite_tables
from benchmarks.targets import Target, evaluate_targets, parse_targets
from elastic_ssm import bench as harness
from elastic_ssm.config import ConfigBase, ConfigError
from elastic_ssm.config.base import load_yaml, read_yaml_file
from elastic_ssm.models.model_dir import CheckpointError
from elastic_ssm.utils.files import check_output_path

__all__ = ["Entry", "Suite", "EntryContext", "suite_dirs", "find_suite", "list_suites", "load_suite",
           "apply_overrides", "select", "run_suite", "RunLog", "SUITE_FIELDS", "suite_command"]

_SUITE_KEYS = {"description", "budget_s", "gpus", "entries"}
_ENTRY_KEYS = {"name", "kind", "target", "targets", "env", "optional", "required"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(kw_only=True)
class Entry:
    """One typed entry: ``options`` is an instance of its kind's options dataclass."""

    name: str
    kind: str
    options: ConfigBase
    targets: list[Target] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    optional: bool = False
    required: bool = False


@dataclass(kw_only=True)
class Suite:
    name: str
    path: Path
    description: str = ""
    budget_s: float = 0.0
    gpus: int = 0
    entries: list[Entry] = field(default_factory=list)


def suite_dirs() -> list[Path]:
    """Where suite names are looked up: ``./configs/bench`` then the checkout's ``configs/bench``."""
    dirs = [Path.cwd() / "configs" / "bench", harness.CHECKOUT / "configs" / "bench"]
    return list(dict.fromkeys(d.resolve() for d in dirs if d.is_dir()))


def list_suites() -> dict[str, Path]:
    """Suite name -> file, over ``suite_dirs()`` (the first folder wins a name)."""
    out: dict[str, Path] = {}
    for d in suite_dirs():
        for p in sorted(d.glob("*.yaml")):
            out.setdefault(p.stem, p)
    return out


def find_suite(name_or_path: str) -> Path:
    """A suite file from a name under ``configs/bench/`` or a path (one-line error naming the choices)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.is_file():
            raise ConfigError(f"bench suite file {p} {'is a folder' if p.is_dir() else 'does not exist'}; give a "
                              "suite YAML file or a name under configs/bench/")
        return p
    known = list_suites()
    if name_or_path not in known:
        raise ConfigError(f"unknown bench suite {name_or_path!r}; choose from {sorted(known)} (configs/bench/) "
                          "or give a path to a YAML file")
    return known[name_or_path]


def _entry(raw: Any, i: int, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry {i + 1} must be a mapping with name and kind, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: entry {i + 1} needs a name of letters, digits, '.', '_' or '-', got {name!r}")
    here = f"{where}, entry {name!r}"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{here}: unknown kind {kind!r}; choose from {sorted(KINDS)}")
    if "target" in raw and "targets" in raw:
        raise ConfigError(f"{here}: give 'target' or 'targets', not both")
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ConfigError(f"{here}: env must map variable names to values, got {env!r}")
    optional, required = raw.get("optional", False), raw.get("required", False)
    for key, value in (("optional", optional), ("required", required)):
        if not isinstance(value, bool):
            raise ConfigError(f"{here}: {key} must be true or false, got {value!r}")
    spec = raw.get("target", raw.get("targets"))
    targets = parse_targets(spec, here) if spec is not None else []
    options = {k: v for k, v in raw.items() if k not in _ENTRY_KEYS}
    try:
        opts = kind_options(kind).from_dict(options)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{here}: {e}") from None
    return Entry(name=name, kind=kind, options=opts, targets=targets, env={k: str(v) for k, v in env.items()},
                 optional=optional, required=required)


def load_suite(name_or_path: str | Path) -> Suite:
    """Parse and validate a suite; nothing runs."""
    path = find_suite(str(name_or_path))
    where = f"bench suite {path}"
    data = read_yaml_file(path, "bench suite")       # syntax errors with line and column, keys given twice
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping with 'entries', got {type(data).__name__}")
    unknown = sorted(set(data) - _SUITE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; a suite has {sorted(_SUITE_KEYS)}")
    raw = data.get("entries")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: 'entries' must be a non-empty list of entries")
    budget, gpus = data.get("budget_s", 0.0), data.get("gpus", 0)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise ConfigError(f"{where}: budget_s must be seconds >= 0 (0: no limit), got {budget!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ConfigError(f"{where}: gpus must be a whole number >= 0, got {gpus!r}")
    entries = [_entry(e, i, where) for i, e in enumerate(raw)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ConfigError(f"{where}: two entries are named {e.name!r}; names must be unique")
        seen.add(e.name)
    return Suite(name=path.stem, path=path, description=str(data.get("description", "")), budget_s=float(budget),
                 gpus=gpus, entries=entries)


def apply_overrides(suite: Suite, sets: tuple[str, ...] = (), options: dict[str, Any] | None = None) -> Suite:
    """Change entry options in place: ``sets`` items ``[ENTRY.]KEY=VALUE`` (VALUE read as YAML) set KEY of the
    named entry or of every entry whose kind has KEY; ``options`` (the other ``--bench.*`` flags given) set
    those fields in every entry whose kind has them. Each changed options object is validated again."""
    changes: list[tuple[str | None, str, Any, str]] = []
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--bench.set {item!r}: write KEY=VALUE or ENTRY.KEY=VALUE, e.g. steps=4")
        head, dot, tail = key.rpartition(".")
        name, key = (head, tail) if dot and head in {e.name for e in suite.entries} else (None, key)
        changes.append((name, key, load_yaml(value, f"--bench.set {item}"), f"--bench.set {item}"))
    for key, value in (options or {}).items():
        changes.append((None, key, value, f"--bench.{key}"))
    for name, key, value, flag in changes:
        hit = False
        for e in suite.entries:
            if (name is None or e.name == name) and key in type(e.options).__dataclass_fields__:
                try:
                    e.options = type(e.options).from_dict({**e.options.to_dict(), key: value})
                except (ConfigError, TypeError, ValueError) as err:
                    raise ConfigError(f"{flag}: entry {e.name!r}: {err}") from None
                hit = True
        if not hit and flag.startswith("--bench.set"):
            raise ConfigError(f"{flag}: no entry of suite {suite.name} has an option {key!r}"
                              + (f" (entry {name!r})" if name else ""))
    return suite


def select(suite: Suite, only: tuple[str, ...]) -> list[Entry]:
    """Entries to run: those ``only`` names (glob patterns; "a,b" is read as "a" and "b") or, without ``only``,
    every non-optional one."""
    only = tuple(p for pat in only for p in pat.split(",") if p)
    if not only:
        return [e for e in suite.entries if not e.optional]
    for pat in only:
        if not any(fnmatch.fnmatchcase(e.name, pat) for e in suite.entries):
            raise ConfigError(f"--bench.only {pat!r} matches no entry of suite {suite.name}; its entries are "
                              f"{[e.name for e in suite.entries]}")
    return [e for e in suite.entries if any(fnmatch.fnmatchcase(e.name, p) for p in only)]


class RunLog:
    """Timestamped, flushed log lines of a suite run, appended to ``path`` (if given; emptied at the start)
    as each is written, so a run cut short by its time limit still leaves its log."""

    def __init__(self, path=None) -> None:
        self.t0 = time.monotonic()
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(self, s: str) -> None:
        s = f"[{time.monotonic() - self.t0:6.1f}s] {s}"
        print(s, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(s + "\n")


@dataclass
class EntryContext:
    """What an entry's run function gets besides its options."""

    name: str
    out_dir: Path
    log: Callable[[str], None]
    deadline: float | None = None
    env: dict[str, str] = field(default_factory=dict)

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a child process: ours, the entry's ``env``, ``extra``, and ``PYTHONPATH`` led by
        the folder this ``elastic_ssm`` is imported from (so ``python -m elastic_ssm...`` finds it)."""
        env = {**os.environ, **self.env, **(extra or {})}
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(harness.CHECKOUT), env.get("PYTHONPATH", "")) if x)
        return env

    def path(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / name

    def write_text(self, name: str, text: str) -> Path:
        p = self.path(name)
        p.write_text(text)
        return p

    def read_text(self, name: str) -> str:
        p = self.out_dir / name
        return p.read_text() if p.is_file() else ""

    def save_json(self, name: str, data: Any) -> Path:
        return self.write_text(name, json.dumps(data, indent=1, default=str))


def run_suite(suite: Suite, *, only: tuple[str, ...] = (), budget_s: float | None = None,
              out_dir: str | Path = "bench_out", docs: str = "", log: Callable[[str], None] | None = None) -> dict:
    """Run the selected entries of ``suite`` in order within ``budget_s`` (None: the suite's; 0: no limit).

    An entry that would start after the budget is skipped, one that raises is recorded with its error and the run
    goes on, unless it is ``required``: then the entries after it are skipped. Returns ``{"env", "suite",
    "budget_s", "entries": [{"name", "kind", "state", "seconds", "rows", "targets"}], "targets", "skipped",
    "stopped_by"}``, written to ``out_dir/<suite>.json`` after every entry; the tables go to ``out_dir/<suite>.md``
    (appended to ``docs`` if given). ``log`` receives every line (default: printed and kept in ``<suite>.log``)."""
    import torch

    if suite.gpus and torch.cuda.device_count() < suite.gpus:
        raise ConfigError(f"bench suite {suite.name} needs {suite.gpus} CUDA GPU(s), this machine has "
                          f"{torch.cuda.device_count()}; run it on a GPU machine or pick a CPU suite such as cpu-smoke")
    entries = select(suite, only)
    budget = suite.budget_s if budget_s is None else budget_s
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = log or RunLog(out / f"{suite.name}.log")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"env": harness.environment(dev), "suite": suite.name, "path": str(suite.path),
                 "description": suite.description, "budget_s": budget, "entries": [], "targets": [], "skipped": [],
                 "stopped_by": None}
    log(f"bench suite {suite.name} on {res['env']['device']}: {len(entries)} entries, "
        f"budget {f'{budget:.0f} s' if budget else 'none'}, output {out}")
    t0 = time.monotonic()
    deadline = t0 + budget if budget else None
    failed = ""                                     # the required entry that failed: the rest are skipped
    for e in entries:
        rec: dict = {"name": e.name, "kind": e.kind, "options": e.options.to_dict(), "env": e.env, "rows": []}
        late = deadline is not None and time.monotonic() >= deadline
        if failed or late:
            rec["state"] = f"skipped: required entry {failed} failed" if failed else "skipped: time budget"
            res["skipped"].append(e.name)
            log(f"== {e.name}: {rec['state']}")
        else:
            log(f"== {e.name} ({e.kind}) [{time.monotonic() - t0:.0f} s]")
            ctx = EntryContext(name=e.name, out_dir=out / e.name, log=log, deadline=deadline, env=e.env)
            t = time.monotonic()
            try:
                with mock.patch.dict(os.environ, e.env):     # the entry's env, restored afterwards
                    rec["rows"] = list(kind_runner(e.kind)(e.options, ctx))
                rec["state"] = "ran"
            except Exception as err:  # one failing entry must not lose the others
                if not isinstance(err, ConfigError | CheckpointError):   # a user's mistake: its one line says it all
                    traceback.print_exc()
                msg = str(err).splitlines()[0][:300] if str(err) else ""
                rec["state"] = f"error: {type(err).__name__}: {msg}"
                failed = e.name if e.required else ""
                res["stopped_by"] = {"entry": e.name, "state": rec["state"]} if failed else None
            rec["seconds"] = round(time.monotonic() - t, 1)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log(f"== {e.name}: {rec['state']} in {rec['seconds']} s")
        rec["targets"] = evaluate_targets(e.targets, rec["rows"], e.name, rec["state"])
        res["entries"].append(rec)
        res["targets"] += rec["targets"]
        harness.write_json(out / f"{suite.name}.json", res)
    text = suite_tables(res)
    log("\n" + text)
    (out / f"{suite.name}.md").write_text(suite_markdown(res))
    log(f"wrote {out / (suite.name + '.json')} and {out / (suite.name + '.md')}")
    if docs:
        harness.append_markdown(docs, res, section=suite_markdown(res))
        log(f"appended to {docs}")
    return res


#: BenchConfig fields that steer a suite run itself; the other flags given override entry options
SUITE_FIELDS = ("suite", "only", "set", "out_dir", "out", "docs", "time_budget_s")


def suite_command(cfg, given: dict) -> dict:
    """``elastic-ssm bench --bench.suite`` with the ``BenchConfig`` ``cfg`` and the fields the user gave (``given``):
    ``list`` prints the suites, else one suite runs (the given fields but ``SUITE_FIELDS`` override entry options);
    a failed entry is a one-line ``ConfigError`` after every result is written; a ``--bench.out_dir`` that cannot be
    written is one before anything runs."""
    if cfg.suite == "list":
        for name, path in list_suites().items():
            s = load_suite(path)
            names = ", ".join(e.name + (" (optional)" if e.optional else "") for e in s.entries)
            print(f"{name:<18} {s.description}\n{'':<18} entries: {names}")
        return {}
    if not cfg.out_dir.strip():
        raise ConfigError("--bench.out_dir is an empty string; give the folder for the suite's results")
    check_output_path("--bench.out_dir", cfg.out_dir, "folder")
    suite = apply_overrides(load_suite(cfg.suite), cfg.set, {k: v for k, v in given.items() if k not in SUITE_FIELDS})
    res = run_suite(suite, only=cfg.only, budget_s=cfg.time_budget_s if "time_budget_s" in given else None,
                    out_dir=cfg.out_dir, docs=cfg.docs)
    if "out" in given and cfg.out:
        harness.write_json(cfg.out, res)
    if res.get("stopped_by"):
        stop = res["stopped_by"]
        raise ConfigError(f"bench suite {suite.name} stopped: its required entry {stop['entry']} failed "
                          f"({stop['state']}); the entries after it did not run (tables in {cfg.out_dir})")
    failed = [e for e in res["entries"] if str(e.get("state", "")).startswith("error")]
    if failed:                      # every entry ran and its results are written; the exit code says some failed
        first = failed[0]
        raise ConfigError(f"bench suite {suite.name}: {len(failed)} of {len(res['entries'])} entries failed, first "
                          f"{first['name']} ({first['state']}); the others' results and the tables are in "
                          f"{cfg.out_dir}")
    return res
