"""Finding the research harness (``benchmarks/`` at the repository root, not installed) from a clone: the suites of
``elastic-ssm bench --bench.suite`` (``benchmarks/suite.py``), their entry kinds (``benchmarks/kinds.py``) and the fla
peers (``benchmarks/fla_peers.py``) are imported by name, from the current folder or the checkout this
``elastic_ssm`` is imported from when they are not importable, else a one-line ``ConfigError``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ..config import ConfigError

__all__ = ["HARNESS", "CHECKOUT", "harness_roots", "harness_module"]

#: the research harness: a top-level package of the repository beside ``elastic_ssm/``, not installed
HARNESS = "benchmarks"
#: the folder this ``elastic_ssm`` is imported from: the clone's root for a checkout or an editable install
CHECKOUT = Path(__file__).resolve().parents[2]


def harness_roots() -> list[Path]:
    """Folders that may hold the harness (``benchmarks/__init__.py``): the current folder, then the checkout this
    ``elastic_ssm`` is imported from (an editable install run from elsewhere)."""
    dirs = [Path.cwd(), CHECKOUT]
    return [d for d in dict.fromkeys(dirs) if (d / HARNESS / "__init__.py").is_file()]


def harness_module(what: str, module: str):
    """``module``; a harness module is looked up in ``harness_roots()`` when it is not importable (the installed
    ``elastic-ssm`` run outside the repository root), else a one-line ``ConfigError`` naming ``what`` needs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if module.partition(".")[0] != HARNESS or not (e.name or "").partition(".")[0] == HARNESS:
            raise
    for root in harness_roots():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        if getattr(sys.modules.get(HARNESS), "__file__", 1) is None:    # a namespace package: some folder named
            for name in [m for m in sys.modules if m.partition(".")[0] == HARNESS]:   # benchmarks/ on sys.path
                del sys.modules[name]
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not (e.name or "").partition(".")[0] == HARNESS:
                raise
    raise ConfigError(f"{what} belongs to the research harness in the repository's {HARNESS}/ folder "
                      f"(not installed with elastic_ssm): run it from the root of a clone ({module} not found)")
