"""pytest plugin: this package's long-context and huge-tensor GPU tests (marker ``long_context``,
minutes each) run only when asked for, so ``pytest -m gpu`` stays a run of a few minutes.

They are left out unless the ``-m`` expression names ``long_context`` (``pytest -m
long_context``) or their file is named on the command line; the run's header and its summary say
how many were left out and how to run them. Other packages' tests are never touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

MARKER = "long_context"
HOW = f"pytest -m {MARKER}"
_WORKER_KEY = "attention_crossval_long_left_out"


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(LongTests(config), LongTests.NAME)


def asked_for(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the run asks for ``item``'s long test: ``-m`` names the marker, or the test's
    file (or the test) is named on the command line."""
    if MARKER in (config.option.markexpr or ""):
        return True
    named = {Path(arg.split("::")[0]).resolve() for arg in config.args}
    return item.path.resolve() in named


class LongTests:
    """Leaves out the long tests the run did not ask for, and says so."""

    NAME = "attention_crossval.long_tests"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.left_out = 0

    @pytest.hookimpl(trylast=True)  # after -m: only the tests that would run are counted
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        from attention_crossval.pytest_plugin import _is_ours

        left = [
            item
            for item in items
            if item.get_closest_marker(MARKER) and _is_ours(item) and not asked_for(config, item)
        ]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if item not in set(left)]
        self.left_out = len(left)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        return [self._line()] if self.left_out else []

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller prints the summary
            workeroutput[_WORKER_KEY] = self.left_out

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: every worker collects the same tests; take one's count."""
        self.left_out = max(self.left_out, getattr(node, "workeroutput", {}).get(_WORKER_KEY, 0))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.left_out and not hasattr(self.config, "workerinput"):
            terminalreporter.write_line(self._line(), yellow=True)

    def _line(self) -> str:
        return (
            f"attention-crossval: left out {self.left_out} long-context and huge-tensor GPU "
            f"tests (marker {MARKER}, minutes each); run them with `{HOW}`"
        )
