"""No import cycle inside ``elastic_ssm``: the graph of module-level imports (``import`` / ``from`` statements at
module level, also inside ``if`` / ``try``, not inside functions and not under ``if TYPE_CHECKING``) is acyclic.

An edge ``m -> t`` is drawn for every module ``t`` that executing ``m``'s import statements runs: the imported
module and each of its packages' ``__init__`` that is not already an ancestor of ``m`` (a sibling import
inside a package does not re-enter the package). ``from p import name`` points at ``p.name`` when that is a
module, else at ``p``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return getattr(t, "id", None) == "TYPE_CHECKING" or getattr(t, "attr", None) == "TYPE_CHECKING"


def _imported(body: list[ast.stmt], package: str, modules: set[str]) -> set[str]:
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.If):
            out |= _imported(node.orelse if _type_checking(node) else node.body + node.orelse, package, modules)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            out |= _imported(node.body + handlers + node.orelse + node.finalbody, package, modules)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package its module-level imports execute."""
    base = package_dir.parent
    paths = {_module_name(p, base): p for p in package_dir.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for m, p in paths.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        edges = set()
        for dep in _imported(ast.parse(p.read_text()).body, package, modules):
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


def test_the_cycle_finder_sees_module_level_cycles_only(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from .b import B\nA = 1\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\nB = 2\n"
                "def late():\n    from .a import A\n",
        "c.py": "try:\n    from . import sub\nexcept ImportError:\n    pass\n",
        "sub/__init__.py": "from .d import D\n",
        "sub/d.py": "from ..c import x\nD = 3\n",
        "e.py": "from .sub import d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == set()     # TYPE_CHECKING, function: no edge
    assert graph["pkg.e"] == {"pkg.sub", "pkg.sub.d"}                  # the package's __init__ runs first
    assert cycles(graph) == [["pkg.c", "pkg.sub", "pkg.sub.d"]]


def test_elastic_ssm_has_no_import_cycle():
    graph = import_graph(ROOT / "elastic_ssm")
    assert len(graph) > 100 and "elastic_ssm.config.run" in graph["elastic_ssm.config"]
    found = cycles(graph)
    assert not found, "import cycles inside elastic_ssm (module-level imports):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_the_tests_mirror_the_package_folders():
    """Issue #17: a test file lives in the folder of the package it tests (``tests/ops/`` for ``elastic_ssm/ops``);
    cross-cutting suites (``faults``) and data (``fixtures``) are the only other folders, CLI and layout tests sit
    at the top."""
    tests = Path(__file__).resolve().parent
    packages = {p.name for p in (ROOT / "elastic_ssm").iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders - packages <= {"faults", "fixtures"}, sorted(folders - packages - {"faults", "fixtures"})
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert "test_cli.py" in top and all(n.startswith("test_cli") or n == "test_imports.py" for n in top), top
