"""scripts/own_kernels_ptx.py's comparison of two PTX dumps, on hand-written PTX (no compiler
needed): it must forgive what a grouping of kernel arguments may change (entry names, the order
of differently declared parameters) and nothing else.

The script belongs to the checkout, so it is loaded from its file; an installed copy without it
skips, saying so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "own_kernels_ptx.py"
pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not SCRIPT.is_file(), reason=f"{SCRIPT} is not in this installation"),
]

# A kernel of two TMA descriptors (q, k) and a scale, in the compiler's spelling.
DECLARATIONS = {"q": ".align 64 .b8 {}[128]", "k": ".align 64 .b8 {}[128]", "scale": ".f32 {}"}


def _ptx(order: list[str], entry: str = "kernel_cutlass_Sm90_kernel") -> str:
    """The kernel with its parameters declared in ``order``; the body reads each by its role,
    so the declaration's position decides which ``param_i`` it names."""
    names = {role: f"{entry}_param_{i}" for i, role in enumerate(order)}
    header = ",\n".join(f"\t.param {DECLARATIONS[r].format(names[r])}" for r in order)
    return (
        f"// the compiler's version\n.visible .entry {entry}(\n{header}\n)\n{{\n"
        f"\tmov.b64 \t%rd1, {names['q']};\n\tmov.b64 \t%rd2, {names['k']};\n"
        f"\tld.param.b32 \t%r1, [{names['scale']}];\n\tret;\n}}\n"
    )


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("own_kernels_ptx_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare(script, tmp_path: Path, before: str, after: str) -> int:
    for side, text in (("before", before), ("after", after)):
        (tmp_path / side).mkdir()
        (tmp_path / side / "k.ptx").write_text(script.normalize(text))
    return script.compare(tmp_path / "before", tmp_path / "after")


def test_renamed_entries_are_identical(script, tmp_path: Path, capsys) -> None:
    before = _ptx(["q", "k", "scale"], "kernel_cutlass_Sm90_kernel_a")
    after = _ptx(["q", "k", "scale"], "kernel_cutlass_Sm90_kernel_refactored")
    assert before != after
    assert _compare(script, tmp_path, before, after) == 0
    assert "1 identical, 0 same up to parameter order, 0 differ" in capsys.readouterr().out


def test_differently_declared_parameters_may_trade_places(script, tmp_path: Path, capsys) -> None:
    """The scale moving before the descriptors: the same code, reported as such."""
    assert _compare(script, tmp_path, _ptx(["q", "k", "scale"]), _ptx(["scale", "q", "k"])) == 0
    assert "0 identical, 1 same up to parameter order, 0 differ" in capsys.readouterr().out


def test_alike_declared_parameters_swapped_differ(script, tmp_path: Path, capsys) -> None:
    """K's descriptor before Q's: the body reads each through the other's position."""
    assert _compare(script, tmp_path, _ptx(["q", "k", "scale"]), _ptx(["k", "q", "scale"])) == 1
    assert "0 identical, 0 same up to parameter order, 1 differ" in capsys.readouterr().out
