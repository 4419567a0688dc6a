"""The package's import graph, read statically from its source files: no import cycle among its
modules, and the kernel contract standing alone (it imports nothing of the harness, the adapters
or the suite), so an adapter author can import it without the machinery that runs kernels.

The cycle check counts every import that can run, at module level or inside a function: an
import moved into a function to break a cycle still hides one (two modules that need each
other's pieces, whose shared piece belongs in a third). The function-local imports that remain
close no cycle; most are lazy on purpose (cutlass, triton, matplotlib, mpmath, hypothesis or
pytest behind them, the contract kept apart from the harness, a CLI subcommand's or the pytest
plugin's start-up), a few light ones could move up. The contract check
counts module-level imports only: what importing the contract runs. Imports under
``if TYPE_CHECKING:`` never run and count nowhere."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

PACKAGE = "attention_crossval"
# found without importing it: a cycle must show here, not as an ImportError at collection
ROOT = Path(importlib.util.find_spec(PACKAGE).origin).parent
CONTRACT = f"{PACKAGE}.kernel.contract"
# what the contract may import from this package: itself and the case model it is written in
CONTRACT_MAY_IMPORT = (CONTRACT, f"{PACKAGE}.reference")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(body: list[ast.stmt], *, local: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that can run: outside TYPE_CHECKING blocks, and outside functions
    unless ``local`` (then at any depth, methods included)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _imports(node.orelse, local=local)
        elif local or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, block, None)
                if isinstance(children, list):
                    yield from _imports(children, local=local)


def _imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(*, local: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level, and with ``local`` inside
    its functions too (a name that is not a module, ``from m import f``, counts as ``m``)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in _imports(tree.body, local=local):
            for name in _imported_names(module, path, node):
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    target = owner(name)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(local=True)
    assert len(graph) > 100, sorted(graph)  # the whole package was read
    assert cycles(graph) == []


def test_imports_counts_function_local_imports_but_not_type_checking_ones() -> None:
    """The walker behind the cycle check sees an import inside a method and a handler, skips one
    under ``if TYPE_CHECKING:`` (it never runs), and without ``local`` sees module level only."""
    tree = ast.parse(
        "import a\n"
        "if TYPE_CHECKING:\n    import hidden\n"
        "class C:\n    def f(self):\n        import b\n"
        "def g():\n    try:\n        pass\n    except ImportError:\n        import c\n"
    )
    names = {n.names[0].name for n in _imports(tree.body, local=True)}
    assert names == {"a", "b", "c"}
    assert {n.names[0].name for n in _imports(tree.body, local=False)} == {"a"}


def test_cycles_finds_a_cycle_through_a_package_module() -> None:
    """The counter itself: a three-module ring and a self-contained pair are found, a chain is
    not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_contract_imports_nothing_of_the_harness() -> None:
    graph = import_graph()
    contract = {module for module in graph if module.startswith(CONTRACT)}
    assert {f"{CONTRACT}.spec", f"{CONTRACT}.known_findings", f"{CONTRACT}.declined"} <= contract
    outside = {
        (module, target)
        for module in contract
        for target in graph[module]
        if not target.startswith(CONTRACT_MAY_IMPORT)
    }
    assert outside == set()
    # and the top-level package (imported first by every import of the contract) stays within
    assert graph[PACKAGE] <= {m for m in graph if m.startswith(CONTRACT_MAY_IMPORT)}


def _test_files() -> list[Path]:
    return sorted(ROOT.rglob("test_*.py")) + sorted(Path(__file__).parent.rglob("test_*.py"))


def test_no_test_file_imports_another() -> None:
    """What two test files share lives in a module of its own (or a conftest), so running or
    moving one never runs the other's tests by import."""
    imports = {
        (path.name, name)
        for path in _test_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _imported_names("", path, node)
        if name.rpartition(".")[2].startswith("test_")
    }
    assert imports == set()


def test_the_shipped_suite_uses_no_test_fixture() -> None:
    """properties/ runs in users' sessions: it imports nothing of attention_crossval.testing
    (the fault kernels and mutants are this project's own test fixtures)."""
    graph = import_graph()
    suite = [module for module in graph if module.startswith(f"{PACKAGE}.properties")]
    assert len(suite) > 10, suite
    uses = {(m, t) for m in suite for t in graph[m] if t.startswith(f"{PACKAGE}.testing")}
    assert uses == set()
