"""reference/parallel.py: per-head forked workers give the serial answer, each with one BLAS
thread (a BLAS pool sized to the machine in every worker oversubscribes the cores)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.parallel import map_heads

pytestmark = pytest.mark.cpu


def _case() -> AttentionCase:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float16)
    k, v = (rng.standard_normal((2, 7, 2, 8)).astype(np.float16) for _ in range(2))
    return AttentionCase(q, k, v)


def _head_sum(case: AttentionCase, b: int, h: int) -> tuple[int, int, float]:
    return b, h, float(case.q.astype(np.float64).sum() + case.k.astype(np.float64).sum())


def _blas_threads(case: AttentionCase, b: int, h: int) -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


HEADS = [(b, h) for b in range(2) for h in range(4)]


def test_workers_give_the_serial_answer() -> None:
    case = _case()
    serial = map_heads(case, _head_sum, HEADS, workers=1)
    assert map_heads(case, _head_sum, HEADS, workers=2) == serial
    for b, h, total in serial:  # each got its own head case (its kv head, h // 2)
        kv = h // 2
        expected = case.q[b, :, h].astype(np.float64).sum() + case.k[b, :, kv].sum(dtype=np.float64)
        assert total == pytest.approx(expected)


def test_each_worker_runs_blas_on_one_thread() -> None:
    if not any(pool["user_api"] == "blas" for pool in threadpool_info()):
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    with threadpool_limits(limits=2, user_api="blas"):  # a parent with a pool of 2
        found = map_heads(_case(), _blas_threads, HEADS, workers=2)
    assert all(threads == [1] * len(threads) and threads for threads in found), found
