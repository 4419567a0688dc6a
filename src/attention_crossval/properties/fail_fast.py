"""Fail fast on a kernel that crashes or hangs, in the kernel suites (pytest route).

A crash or a timeout kills the kernel's worker, and every further call pays a new worker, or
the whole timeout again. Hypothesis would shrink such a failure by calling the kernel dozens of
times, so the kernel tests stop at the first one instead:

* :func:`stop_on_fault`, called in a Hypothesis test body after each kernel call, raises
  :class:`KernelFaulted` at the first ``crash`` or ``timeout`` finding, with the case as drawn
  (saved, with its replay command). It is a ``BaseException`` that Hypothesis does not treat as
  a test failure, so it ends the run at once: no shrinking, no further example. Other findings
  (numerical ones, a kernel's exception) are raised as usual and shrink normally.
* :func:`run_failing_fast` (around a Hypothesis run) and :func:`fails_fast` (a test decorator)
  turn it into the test's failure without a traceback, apply ``--kernel-timeout`` to the
  kernel's worker, and fail a test at once, without calling the kernel, once that kernel has
  crashed or hung :data:`SESSION_FAULT_LIMIT` times in this session, naming those faults.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar

import pytest

from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.verdict import CheckFailed, Verdict
from attention_crossval.properties.kernels_under_test import kernel_adapter
from attention_crossval.properties.replay import current_test, reproducer_on_failure
from attention_crossval.reference.case import AttentionCase

FAULT_CHECKS = ("crash", "timeout")
# Faults of one kernel after which its remaining tests fail without calling it: one crash may
# be a rare case; a second in another test says the kernel fails on ordinary ones.
SESSION_FAULT_LIMIT = 2

T = TypeVar("T")
_faults: dict[str, list[str]] = {}  # kernel -> "<check>: <message> (in <test>)", this session


class KernelFaulted(BaseException):
    """The first crash or timeout of a Hypothesis test (its message is the failure's text).

    A ``BaseException`` but not an ``Exception``, ``SystemExit`` or pytest's ``Failed``: those
    Hypothesis takes as a failing example to shrink; this one ends the run at once."""


def stop_on_fault(kernel: str, verdict: Verdict, case: AttentionCase | None = None) -> None:
    """Raise :class:`KernelFaulted` if ``verdict`` holds a ``crash`` or ``timeout`` finding,
    after recording it against ``kernel`` and saving ``case`` (when given) with its replay
    command; otherwise return."""
    __tracebackhide__ = True
    faults = [finding for finding in verdict.findings if finding.check in FAULT_CHECKS]
    if not faults:
        return
    try:
        with nullcontext() if case is None else reproducer_on_failure(case):
            verdict.raise_for(*FAULT_CHECKS)
    except CheckFailed as failed:
        text = "\n".join([str(failed), *getattr(failed, "__notes__", ())])
    first = faults[0]
    _faults.setdefault(kernel, []).append(
        f"{first.check}: {first.message.splitlines()[0]} (in {current_test()})"
    )
    raise KernelFaulted(
        f"{text}\n  reported as drawn, not shrunk: each shrink step would call the kernel again"
    )


def run_failing_fast(kernel: str, config: pytest.Config, run: Callable[[], T]) -> T:
    """``run()``, a kernel test's Hypothesis run, with the kernel's worker on
    ``--kernel-timeout``; fails at once, without running it, if the kernel already faulted
    :data:`SESSION_FAULT_LIMIT` times; :class:`KernelFaulted` becomes the test's failure,
    without a traceback."""
    __tracebackhide__ = True
    earlier = _faults.get(kernel, [])
    if len(earlier) >= SESSION_FAULT_LIMIT:
        listed = "\n  ".join(earlier)
        pytest.fail(
            f"{kernel} crashed or hung {len(earlier)} times in this session; its remaining "
            f"tests fail without calling it:\n  {listed}",
            pytrace=False,
        )
    adapter = kernel_adapter(kernel)
    if isinstance(adapter, IsolatedKernel):
        adapter.timeout_s = config.getoption("--kernel-timeout")
    try:
        return run()
    except KernelFaulted as fault:
        message = str(fault)
    pytest.fail(message, pytrace=False)  # outside the except: one message, no chained traceback


def fails_fast(test: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`run_failing_fast` around a test taking the ``kernel`` and ``request`` arguments
    (put it above ``@given``, so a fault ends the whole Hypothesis run)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        config = kwargs["request"].config
        return run_failing_fast(kwargs["kernel"], config, lambda: test(*args, **kwargs))

    return wrapper
