"""The package's structure (issue 38): no import cycle inside ``elastic_ssm``, no import on a hot path, and the
layout of ``tests/``.

The import graph counts every import statement of a module, wherever it stands: at module level, under ``if`` /
``try``, inside functions and classes, and under ``if TYPE_CHECKING``. An import moved into a function still ties
the two modules, so it cannot hide a cycle. An edge ``m -> t`` is drawn for every module ``t`` that executing
``m``'s import statements runs: the imported module and each of its packages' ``__init__`` that is not already an
ancestor of ``m`` (a sibling import inside a package does not re-enter the package). ``from p import name``
points at ``p.name`` when that is a module, else at ``p``.

Hot paths: ``forward`` and ``step`` of the layers, models, ops and elastic modules, and every function of the
package they call (followed through ``self.method``, module functions and names imported from the package),
hold no import statement, but of an optional extra (``OPTIONAL_EXTRAS``) or of a module that imports one at its
top (the Triton kernel modules): ``import elastic_ssm`` never loads those, so they load where their path first
runs.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """Every module an import statement anywhere in ``tree`` names: at module level, inside functions and
    classes, under ``if`` / ``try`` and under ``if TYPE_CHECKING`` (a type-only import is a dependency too)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _target(node, package)
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package its imports (anywhere in the file) execute."""
    base = package_dir.parent
    paths = {_module_name(p, base): p for p in package_dir.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for m, p in paths.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        edges = set()
        for dep in _imported(ast.parse(p.read_text()), package, modules):
            parts = dep.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != m and not m.startswith(prefix + "."):
                    edges.add(prefix)
        graph[m] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:                    # Tarjan; the package graph is shallow, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycle_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One loop of imports through the strongly connected ``comp``: ``[a, b, ..., a]`` (shortest from ``a``)."""
    start, inside = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle_path(graph, c)) for c in found)


def test_the_cycle_finder_counts_every_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from .b import B\nA = 1\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\nB = 2\n",
        "c.py": "try:\n    from .sub import d\nexcept ImportError:\n    pass\n",
        "sub/__init__.py": "X = 1\n",
        "sub/d.py": "D = 3\ndef late():\n    from ..e import E\n",
        "e.py": "from .sub import d\nclass E:\n    def f(self):\n        import pkg.a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.c"}                                 # under TYPE_CHECKING: an edge
    assert graph["pkg.c"] == {"pkg.sub", "pkg.sub.d"}                  # the package's __init__ runs first
    assert graph["pkg.sub.d"] == {"pkg.e"} and graph["pkg.e"] == {"pkg.sub", "pkg.sub.d", "pkg.a"}  # in functions
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.c", "pkg.e", "pkg.sub.d"]]
    assert cycle_path(graph, found[0]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.e", "pkg.a"]


@pytest.fixture(scope="module")
def graph():
    g = import_graph(ROOT / "elastic_ssm")
    assert len(g) > 80 and "elastic_ssm.config.run" in g["elastic_ssm.config"]
    return g


def test_elastic_ssm_has_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles inside elastic_ssm (every import counts):\n" + _describe(graph, found)


#: the core (DESIGN.md "Layout") and the edge; a core module's imports (anywhere in it) reach no edge module
CORE_PACKAGES = ("config", "spectral", "ops", "layers", "models", "elastic", "train", "data", "eval", "hf", "utils")
EDGE = ("elastic_ssm.cli", "elastic_ssm.serve", "elastic_ssm.bench", "elastic_ssm.quickstart")


def test_the_core_imports_nothing_of_the_edge(graph):
    """The verbs of every area live at the edge (``cli_*.py``, ``serve/cli.py``): no module of a core package
    imports the CLI, the server or the bench, directly or through another core module."""
    core = {m for m in graph if m.split(".")[1:2] and m.split(".")[1] in CORE_PACKAGES}
    bad = []
    for m in sorted(core):
        seen, todo = set(), [m]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep.startswith(EDGE):
                    bad.append(f"{m} -> ... -> {dep}")
                elif dep in core and dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
    assert not bad, "core modules reaching the edge:\n" + "\n".join(bad[:20])


HOT_PACKAGES = ("layers", "models", "ops", "elastic")


class _Functions:
    """Every function of ``elastic_ssm`` by ``module:qualname``, with the names each module binds to the package."""

    def __init__(self, package_dir: Path) -> None:
        base = package_dir.parent
        self.defs: dict[str, ast.AST] = {}
        self.names: dict[str, dict[str, str]] = {}          # module -> local name -> module or module:function
        self.packages: dict[str, str] = {}                  # module -> the package its relative imports start at
        self.top: dict[str, set[str]] = {}                  # module -> what its module-level statements import
        self.modules = modules = {_module_name(p, base): p for p in package_dir.rglob("*.py")}
        for m, p in modules.items():
            tree = ast.parse(p.read_text())
            package = self.packages[m] = m if p.name == "__init__.py" else m.rpartition(".")[0]
            names = self.names.setdefault(m, {})
            self.top[m] = _imported(ast.Module(body=[n for n in tree.body if not isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[]), package, set(modules))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.defs[f"{m}:{node.name}"] = node
                elif isinstance(node, ast.ClassDef):
                    for f in node.body:
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.defs[f"{m}:{node.name}.{f.name}"] = f
                elif isinstance(node, ast.ImportFrom):
                    target = _target(node, package)
                    for a in node.names:
                        full = f"{target}.{a.name}"
                        names[a.asname or a.name] = full if full in modules else f"{target}:{a.name}"

    def callees(self, key: str) -> set[str]:
        """The package's functions that the body of ``key`` calls by a name this checker can resolve."""
        m, _, qual = key.partition(":")
        cls = qual.rpartition(".")[0]
        out = set()
        for node in ast.walk(self.defs[key]):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name):
                out |= {f"{m}:{f.id}", self.names[m].get(f.id, "")}
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if f.value.id == "self" and cls:
                    out.add(f"{m}:{cls}.{f.attr}")
                elif f.value.id in self.names[m]:
                    out.add(f"{self.names[m][f.value.id]}:{f.attr}")
        return {c for c in out if c in self.defs}


    def loads_an_extra(self, module: str) -> bool:
        """True when importing ``module`` (a name of the package or not) imports an optional extra at once."""
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m.partition(".")[0] in OPTIONAL_EXTRAS:
                return True
            if m in self.top and m not in seen:
                seen.add(m)
                todo += list(self.top[m])
        return False


#: Optional extras (DESIGN rule 5: ``import elastic_ssm`` never imports them). A hot function may import one, or a
#: module that imports one at its top (the Triton kernel modules), where its path first runs.
OPTIONAL_EXTRAS = ("triton", "fla")


def hot_path_imports(package_dir: Path) -> list[str]:
    """``module:function line: statement`` of every import inside ``forward`` / ``step`` of the hot packages and
    inside every package function reached from them, but for imports of the optional extras."""
    fns = _Functions(package_dir)
    roots = [k for k in fns.defs if k.partition(":")[0].split(".")[1:2] in ([p] for p in HOT_PACKAGES)
             and k.rpartition(".")[2].rpartition(":")[2] in ("forward", "step")]
    seen, todo = set(roots), list(roots)
    while todo:
        for c in fns.callees(todo.pop()) - seen:
            seen.add(c)
            todo.append(c)
    found = []
    for k in seen:
        m = k.partition(":")[0]
        for n in ast.walk(fns.defs[k]):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                targets = _imported(n, fns.packages[m], set(fns.modules))
                if not all(fns.loads_an_extra(t) for t in targets):
                    found.append(f"{k} line {n.lineno}: {ast.unparse(n)}")
    return sorted(found)


def test_the_hot_path_checker_follows_calls(tmp_path):
    pkg = tmp_path / "pkg" / "layers"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("def per_token():\n    import math\n    import triton\n    from .k import kern\n\n"
                                 "def cold():\n    import json\n")
    (pkg / "k.py").write_text("import triton.language as tl\nkern = 1\n")
    (pkg / "layer.py").write_text("from .util import per_token\nfrom . import util\n\nclass L:\n"
                                  "    def forward(self):\n        return self._mix()\n"
                                  "    def _mix(self):\n        per_token()\n\n"
                                  "    def step(self):\n        util.per_token()\n\n"
                                  "    def save(self):\n        import os\n")
    assert hot_path_imports(tmp_path / "pkg") == ["pkg.layers.util:per_token line 2: import math"]


def test_no_import_on_a_hot_path():
    found = hot_path_imports(ROOT / "elastic_ssm")
    assert not found, "imports inside forward / step or a function they call:\n" + "\n".join(found)


def test_the_tests_mirror_the_package_folders():
    """Issue #17: a test file lives in the folder of the package it tests (``tests/ops/`` for ``elastic_ssm/ops``,
    ``tests/benchmarks/`` for the top-level ``benchmarks/``); cross-cutting suites (``faults``) and data
    (``fixtures``) are the only other folders, CLI and layout tests sit at the top."""
    tests = Path(__file__).resolve().parent
    packages = {p.name for p in (ROOT / "elastic_ssm").iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    extra = {"faults", "fixtures", "benchmarks"}      # benchmarks: the research harness beside the package
    assert folders - packages <= extra, sorted(folders - packages - extra)
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert "test_cli.py" in top and all(n.startswith("test_cli") or n == "test_import_graph.py" for n in top), top


def test_the_package_has_no_import_of_the_harness():
    """Issue #38: ``benchmarks/`` (the research harness beside the package, not installed) uses the library, never
    the reverse: no import statement of ``elastic_ssm`` names it (``bench/harness.py`` loads its suites by name)."""
    found = []
    for p in sorted((ROOT / "elastic_ssm").rglob("*.py")):
        m = _module_name(p, ROOT)
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for dep in _imported(ast.parse(p.read_text()), package, set()):
            if dep.partition(".")[0] == "benchmarks":
                found.append(f"{m}: {dep}")
    assert not found, found


def test_importing_every_module_of_the_package_loads_no_harness():
    """``import elastic_ssm`` and then every module under it, from the repository root (where ``benchmarks`` is
    importable): ``benchmarks`` is never loaded. A module whose optional extra is missing is left out."""
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys, elastic_ssm\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'benchmarks']\n"
            "for info in pkgutil.walk_packages(elastic_ssm.__path__, 'elastic_ssm.'):\n"
            "    try:\n"
            "        importlib.import_module(info.name)\n"
            "    except ImportError as e:\n"
            "        if (e.name or '').split('.')[0] not in ('triton', 'fla'):\n"
            "            raise\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
