"""Go-to-definition as an editor does it (jedi): every ``from attention_crossval... import name``
of a module must lead to a file of the package under test, in a checkout and in an install."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# A dev dependency: without it (a GPU host's bare image) the modules that check go-to-definition
# skip at collection instead of stopping every other test's run with an import error.
jedi = pytest.importorskip("jedi")

# A module of each part: the public surface, the contract, the harness, an adapter, the
# report, the kernel suite.
REPRESENTATIVE = (
    "__init__.py",
    "kernel/contract/spec.py",
    "kernel/harness/forward.py",
    "kernel/adapters/streaming.py",
    "report/runner.py",
    "properties/test_kernels.py",
)


def unresolved(package: Path, sys_path: list[Path]) -> tuple[int, list[str]]:
    """(imported names looked up, those that jedi does not follow to a file under ``package``)
    over the :data:`REPRESENTATIVE` modules of ``package``, ``sys_path`` the only import path."""
    # only ``sys_path``: an editable install elsewhere in this environment must not answer
    project = jedi.Project(
        path=package.parent, sys_path=[str(p) for p in sys_path], smart_sys_path=False
    )
    looked_up, misses = 0, []
    for relative in REPRESENTATIVE:
        path = package / relative
        source = path.read_text()
        script = jedi.Script(source, path=path, project=project)
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "attention_crossval"
            ):
                continue
            for alias in node.names:
                looked_up += 1
                targets = script.goto(alias.lineno, alias.col_offset, follow_imports=True)
                files = [t.module_path for t in targets if t.module_path is not None]
                if not any(Path(f).resolve().is_relative_to(package.resolve()) for f in files):
                    misses.append(
                        f"{relative}:{alias.lineno} {node.module}.{alias.name} -> {files}"
                    )
    return looked_up, misses
