"""CPU kernels that end their call abnormally, and log every call, for the fail-fast tests and
``benchmarks/bench_faults.py``.

Each factory returns a :class:`LoggedFaultyAdapter`: ``cpu_faults.FaultyAdapter``'s faults
(``segfault``, ``sys_exit``, ``hang``), plus ``exit0`` (``os._exit(0)``: a clean exit status,
no Python clean-up) and ``interrupt`` (the kernel raises ``KeyboardInterrupt`` itself). When
``$CPU_FAULTS_CALL_LOG`` names a file, every call first appends a line (the fault's name) to it,
so a test can count how often the harness called a crashing kernel across worker restarts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.testing.broken.cpu_faults import FaultyAdapter

CALL_LOG_ENV = "CPU_FAULTS_CALL_LOG"


@dataclass
class LoggedFaultyAdapter(FaultyAdapter):
    """A :class:`FaultyAdapter` that logs each call to ``$CPU_FAULTS_CALL_LOG``."""

    def __call__(self, case: AttentionCase) -> AttentionResult:
        log = os.environ.get(CALL_LOG_ENV)
        if log:
            with open(log, "a") as calls:
                calls.write(f"{self.fault}\n")
        if self.fault == "exit0":
            os._exit(0)
        if self.fault == "interrupt":
            raise KeyboardInterrupt("deliberate, inside the kernel")
        return super().__call__(case)


def segfault() -> LoggedFaultyAdapter:
    return LoggedFaultyAdapter("segfault")


def sys_exit() -> LoggedFaultyAdapter:
    return LoggedFaultyAdapter("sys_exit")


def exit0() -> LoggedFaultyAdapter:
    return LoggedFaultyAdapter("exit0")


def hang() -> LoggedFaultyAdapter:
    return LoggedFaultyAdapter("hang")


def interrupt() -> LoggedFaultyAdapter:
    return LoggedFaultyAdapter("interrupt")


def none() -> LoggedFaultyAdapter:
    """No fault: the streaming tier, logged (the baseline of the call counts)."""
    return LoggedFaultyAdapter("none")
