"""Where a check's time goes: seconds and calls per named phase, on ``time.perf_counter``.

Always on: a phase costs two clock reads and a dict update. Phases nest, and a phase's own
seconds exclude the phases opened inside it (a bound computing its float64 reference counts the
reference as ``float64`` only), so the phases of a stretch of work add up to at most its wall
time. Each thread nests on its own; the totals are the process's. A kernel worker sends the
phases of each call back with its answer and the caller adds them inside its own open phase
(:meth:`PhaseClock.add`), so a worker's compile counts as ``compile``, its call as ``kernel``, and
the rest of the round trip as ``transfer``. The pytest plugin takes the totals per test
(properties/phase_timings.py); benchmarks/bench_gpu_phases.py prints them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

# Every phase the harness, the references and the kernel suite record, with what it covers.
PHASES = {
    "worker_start": "a kernel worker's spawn, imports and kernel set-up, until its handshake",
    "compile": "a kernel call that compiled (or loaded from a compile cache) a configuration, "
    "where the adapter can tell",
    "case_build": "Hypothesis drawing and building a case (the kernel suite's strategies)",
    "kernel": "the adapter's call: device copies, guard bands, prefill and the kernel itself",
    "transfer": "a worker call's round trip beyond the worker's own phases (pickling, mapped "
    "inputs, the pipe)",
    "float64": "the float64 reference (every row, or a long case's row plan)",
    "exact": "the exact tier (mpmath) on the sampled rows",
    "streaming": "the streaming emulation of the declared precision chain (bound triage)",
    "bound": "the derived error bounds of the declared precision chain",
    "sample": "choosing the exact tier's rows and a long case's row plan",
    "scan": "a long case's float32 scan for the rows where the kernel looks worst",
    "compare": "comparing a result with a reference tier under the bound",
}

P = ParamSpec("P")
R = TypeVar("R")
Phases = dict[str, tuple[float, int]]  # phase -> (own seconds, calls)


@dataclass
class Span:
    """One timed phase: its own seconds (nested phases excluded), set when it ends."""

    name: str
    seconds: float = 0.0


class PhaseClock:
    """Seconds and calls per phase for this process (thread-safe; nesting per thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}
        self._local = threading.local()

    def _stack(self) -> list[float]:
        """Per open phase of this thread: the seconds of the phases nested in it so far."""
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """Time the block as ``name``, less the phases nested in it."""
        span, stack = Span(name), self._stack()
        stack.append(0.0)
        start = time.perf_counter()
        try:
            yield span
        finally:
            elapsed = time.perf_counter() - start
            span.seconds = elapsed - stack.pop()
            if stack:
                stack[-1] += elapsed
            self._record(name, span.seconds, 1)

    def add(self, phases: Mapping[str, tuple[float, int]]) -> None:
        """Phases measured elsewhere (a worker's), during this thread's open phase: counted as
        nested in it, so they are not counted twice."""
        stack = self._stack()
        if stack:
            stack[-1] += sum(seconds for seconds, _ in phases.values())
        for name, (seconds, calls) in phases.items():
            self._record(name, seconds, calls)

    def _record(self, name: str, seconds: float, calls: int) -> None:
        with self._lock:
            total = self._totals.setdefault(name, [0.0, 0])
            total[0] += seconds
            total[1] += calls

    def take(self) -> Phases:
        """The totals since the last ``take``, which starts them again from zero."""
        with self._lock:
            taken = {name: (seconds, int(calls)) for name, (seconds, calls) in self._totals.items()}
            self._totals.clear()
        return taken


CLOCK = PhaseClock()


def phase(name: str) -> contextlib.AbstractContextManager[Span]:
    """:meth:`PhaseClock.phase` on this process's clock."""
    return CLOCK.phase(name)


def in_phase(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: every call of the function is timed as phase ``name``."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            with CLOCK.phase(name):
                return function(*args, **kwargs)

        return timed

    return decorate


@contextlib.contextmanager
def compiles(cache_size: Callable[[], int]) -> Iterator[None]:
    """Count the block as ``compile`` when ``cache_size()`` (the entries of a kernel library's
    compile cache) grew in it: the call that compiled, or loaded from a file cache, a
    configuration; otherwise the block stays in the phase around it."""
    before, start = cache_size(), time.perf_counter()
    yield
    if cache_size() > before:
        CLOCK.add({"compile": (time.perf_counter() - start, 1)})


def merged(*parts: Mapping[str, tuple[float, int]]) -> Phases:
    """The sum of several phase totals."""
    total: dict[str, list[float]] = {}
    for part in parts:
        for name, (seconds, calls) in part.items():
            entry = total.setdefault(name, [0.0, 0])
            entry[0] += seconds
            entry[1] += calls
    return {name: (seconds, int(calls)) for name, (seconds, calls) in total.items()}
