"""A quiet run names each failure as it happens and ends with the list.

Under ``pytest -q`` (serial and ``-n 2``) every failing test of this package prints
``FAILED <test id> <finding>`` as soon as it finishes (the harness check's own first line, e.g.
``bound: ...``), so a run cut short still shows what failed, and the run's last lines before
pytest's count are those lines again. Tests of other projects get no such lines.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.pytest_plugin import one_line_finding

pytestmark = pytest.mark.cpu

PLUGIN = "attention_crossval.pytest_plugin"
ROOT = Path(__file__).resolve().parents[1]
OURS = "[pytest]\nattention_crossval_strict = true\n"  # the session treats its tests as ours

FAILING_TESTS = """
import os

import pytest

from attention_crossval.kernel.harness.verdict import CheckFailed

pytestmark = pytest.mark.cpu


def test_passes():
    pass


def test_bound():
    raise CheckFailed("bound: max |err| 3.1e-03 > bound 1.0e-03 at row 5\\n  kernel k, case c")


@pytest.mark.parametrize("x", [1, 2])
def test_plain_assert(x):
    assert x == 1


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_setup_error(broken):
    pass


def test_process_killed():
    if os.environ.get("KILL_THE_RUN"):
        os._exit(3)  # the run cut short: no summary at all
"""

EXPECTED = [
    "FAILED test_failing.py::test_bound bound: max |err| 3.1e-03 > bound 1.0e-03 at row 5",
    "FAILED test_failing.py::test_plain_assert[2] AssertionError: assert 2 == 1",
    "ERROR test_failing.py::test_setup_error RuntimeError: fixture broke",
]
HEADER = "attention-crossval failures (3)"


def _run(pytester: pytest.Pytester, monkeypatch, *args: str) -> list[str]:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    )
    pytester.makepyfile(test_failing=FAILING_TESTS)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-q", *args)
    return [line.rstrip() for line in result.outlines]


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "n2"])
def test_quiet_run_prints_each_failure_live_and_ends_with_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, xdist: bool
) -> None:
    pytester.makefile(".ini", pytest=OURS)
    lines = _run(pytester, monkeypatch, *(("-n", "2", "-p", "xdist") if xdist else ()))
    reports = next(i for i, line in enumerate(lines) if line.startswith("=") and "ERRORS" in line)
    live = [line for line in lines[:reports] if line in EXPECTED]
    assert sorted(live) == sorted(EXPECTED)  # each once, before pytest's own sections
    end = next(i for i, line in enumerate(lines) if HEADER in line)
    assert sorted(lines[end + 1 : end + 4]) == sorted(EXPECTED)
    assert lines[end + 4 :] == [lines[-1]] and "2 failed" in lines[-1]  # then only the count
    if not xdist:
        assert live == EXPECTED  # in the order the tests ran


def test_a_run_cut_short_keeps_the_lines_printed_so_far(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".ini", pytest=OURS)
    monkeypatch.setenv("KILL_THE_RUN", "1")
    lines = _run(pytester, monkeypatch)
    assert [line for line in lines if line in EXPECTED] == EXPECTED
    assert not any(HEADER in line or "short test summary" in line for line in lines)


def test_other_projects_tests_get_no_lines(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = _run(pytester, monkeypatch)
    assert "2 failed" in lines[-1]
    assert not [line for line in lines if line in EXPECTED or "attention-crossval" in line]


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (CheckFailed("lse: max |err| 2.0 > 1.0 (case saved: x.npz)\n  kernel k"),
         "lse: max |err| 2.0 > 1.0 (case saved: x.npz)"),
        (AssertionError("\nassert 2 == 1\n +  where 2 = f()"), "AssertionError: assert 2 == 1"),
        (RuntimeError(), "RuntimeError"),
        (ExceptionGroup("Hypothesis found 2 distinct failures.",
                        [CheckFailed("bound: a\n b"), ValueError("c")]), "bound: a (and 1 more)"),
    ],
)  # fmt: skip
def test_one_line_finding(error: BaseException, line: str) -> None:
    assert one_line_finding(error) == line
