"""The phase clock (kernel/harness/phases.py): nested phases count once, a worker's phases are
taken out of the caller's, a compile is seen where a cache grows; and a kernel worker reports
its call."""

from __future__ import annotations

import time

import numpy as np
import pytest

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.phases import CLOCK, PhaseClock, compiles, phase
from attention_crossval.reference.case import AttentionCase

pytestmark = pytest.mark.cpu


def test_nested_phases_count_once_and_add_up_to_the_wall() -> None:
    clock = PhaseClock()
    start = time.perf_counter()
    with clock.phase("bound"):
        time.sleep(0.02)
        with clock.phase("float64"):
            time.sleep(0.03)
        clock.add({"compile": (0.01, 1)})
    wall = time.perf_counter() - start
    taken = clock.take()
    assert taken["float64"][0] >= 0.03 and taken["compile"] == (0.01, 1)
    own = taken["bound"][0]  # its own time only: less float64's and the added compile's
    assert own >= 0.02 - 0.01 and own == pytest.approx(wall - taken["float64"][0] - 0.01, abs=2e-3)
    assert sum(seconds for seconds, _ in taken.values()) == pytest.approx(wall, abs=2e-3)
    assert clock.take() == {}  # take starts again from zero


def test_a_compile_is_the_call_that_grew_the_cache() -> None:
    cache: dict[str, int] = {}
    CLOCK.take()
    with phase("kernel"):
        with compiles(lambda: len(cache)):
            cache["config"] = 1
        with compiles(lambda: len(cache)):
            pass  # the cache did not grow: stays in "kernel"
    taken = CLOCK.take()
    assert taken["compile"][1] == 1 and taken["kernel"][1] == 1


def test_a_worker_call_reports_its_kernel_and_transfer() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 1, 16)).astype(np.float16) for _ in "qkv")
    worker = IsolatedKernel("attention_crossval.kernel.adapters.streaming:create")
    try:
        CLOCK.take()
        verdict = run_case(worker, AttentionCase(q, k, v))
        taken = CLOCK.take()
    finally:
        worker.close()
    assert verdict.passed, verdict.findings
    assert taken["worker_start"][1] == 1
    assert taken["kernel"][1] == taken["transfer"][1] == 2  # two runs, timed in the worker
    assert {"float64", "exact", "bound", "compare"} <= set(taken)
