"""pytest plugin: where each of this package's tests spends its time, by phase
(:mod:`kernel.phases`), and ``--phase-timings PATH`` to write it as JSON.

Each test's phases are taken from the process's clock when it ends and travel on its teardown
report (across xdist too); the controller writes every test's phases, its kernel, outcome and
seconds, and per process the phases outside tests (worker starts while collecting, workers
closed between tests). benchmarks/bench_gpu_phases.py runs a pytest selection with it and
prints the table. Only this package's tests are touched (``pytest_plugin._is_ours``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from attention_crossval.kernel.harness.phases import CLOCK, Phases, merged, phase

OPTION = "--phase-timings"
ATTRIBUTE = "attention_crossval_phases"  # on a test's teardown report: its phases
_WORKER_KEY = "attention_crossval_phases"  # an xdist worker's workeroutput: its outside phases


def timed_cases(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``strategy`` with each draw timed as ``case_build`` (the same choices, so the same cases
    for a seed)."""

    @st.composite
    def timed(draw: st.DrawFn) -> Any:
        with phase("case_build"):
            return draw(strategy)

    return timed()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("attention").addoption(
        OPTION,
        default=None,
        metavar="PATH",
        help="write the seconds and calls per phase (worker start, compile, case build, kernel, "
        "references, compare) of each of this package's tests to PATH as JSON "
        "(benchmarks/bench_gpu_phases.py prints them as a table)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(PhaseTimings(config), PhaseTimings.NAME)


def _tagged(where: str) -> Phases:
    """The clock's phases since the last take, each named ``where:phase``."""
    return {f"{where}:{name}": value for name, value in CLOCK.take().items()}


def _listed(phases: Phases) -> dict[str, list[float]]:
    return {name: [seconds, calls] for name, (seconds, calls) in phases.items()}


class PhaseTimings:
    """Per process: takes each of this package's tests' phases from the clock, and the phases
    outside tests; where the terminal is, gathers them and writes ``--phase-timings``."""

    NAME = "attention_crossval.phase_timings"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.start = time.perf_counter()
        self.collection_s: float | None = None
        self.outside: Phases = {}  # this process, outside tests: "collect:..." and "between:..."
        self.tests: dict[str, dict[str, Any]] = {}  # where the terminal is: by node id
        self.processes: list[dict[str, Any]] = []  # xdist workers' outside phases

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            self.collection_s = time.perf_counter() - start
            self.outside = merged(self.outside, _tagged("collect"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Before the test's fixtures: what the clock holds until now was outside tests."""
        if _ours(item):
            self.outside = merged(self.outside, _tagged("between"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):
        report = yield
        if call.when == "teardown" and _ours(item):
            callspec = getattr(item, "callspec", None)
            kernel = callspec.params.get("kernel") if callspec is not None else None
            setattr(report, ATTRIBUTE, {"kernel": kernel, "phases": _listed(CLOCK.take())})
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Where the terminal is (xdist's controller, or the only process)."""
        if hasattr(self.config, "workerinput"):
            return
        test = self.tests.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed"})
        test["seconds"] += report.duration
        if report.outcome != "passed" and test["outcome"] == "passed":
            test["outcome"] = report.outcome
        taken = getattr(report, ATTRIBUTE, None)
        if taken is not None:
            node = getattr(report, "node", None)
            test |= taken | {"process": getattr(node, "workerinput", {}).get("workerid", "main")}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: an xdist worker's phases outside tests."""
        sent = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
        if sent is not None:
            self.processes.append(sent)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        own = {
            "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "collection_s": self.collection_s,
            "phases": _listed(merged(self.outside, _tagged("between"))),
        }
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its part goes to the controller
            workeroutput[_WORKER_KEY] = own
            return
        path = self.config.getoption(OPTION)
        if not path:
            return
        tests = [
            {"nodeid": nodeid} | test for nodeid, test in self.tests.items() if "phases" in test
        ]
        timings = {
            "session_s": time.perf_counter() - self.start,
            "xdist_workers": getattr(self.config.option, "numprocesses", None) or 0,
            "tests": tests,
            "processes": self.processes or [own],
        }
        Path(path).write_text(json.dumps(timings, indent=1))


def _ours(item: pytest.Item) -> bool:
    from attention_crossval.pytest_plugin import _is_ours

    return _is_ours(item)
