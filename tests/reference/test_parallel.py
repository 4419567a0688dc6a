"""reference/parallel.py: forked workers give the serial answer, each with one BLAS thread (a
BLAS pool sized to the machine in every worker oversubscribes the cores); units keep a GQA
group's heads together only as far as every worker still gets one."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.parallel import map_heads, unit_case, work_units

pytestmark = pytest.mark.cpu


def _case() -> AttentionCase:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float16)
    k, v = (rng.standard_normal((2, 7, 2, 8)).astype(np.float16) for _ in range(2))
    return AttentionCase(q, k, v)


def _head_sum(case: AttentionCase, b: int, hs: tuple[int, ...]) -> list[tuple[int, int, float]]:
    k_sum = case.k.astype(np.float64).sum()
    return [
        (b, h, float(case.q[:, :, j].astype(np.float64).sum() + k_sum)) for j, h in enumerate(hs)
    ]


def _blas_threads(case: AttentionCase, b: int, hs: tuple[int, ...]) -> list[list[int]]:
    threads = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    return [threads] * len(hs)


HEADS = [(b, h) for b in range(2) for h in range(4)]


def test_workers_give_the_serial_answer() -> None:
    case = _case()
    serial = map_heads(case, _head_sum, HEADS, workers=1)
    assert map_heads(case, _head_sum, HEADS, workers=2) == serial
    for b, h, total in serial:  # each head met its own q and its kv head (h // 2)
        kv = h // 2
        expected = case.q[b, :, h].astype(np.float64).sum() + case.k[b, :, kv].sum(dtype=np.float64)
        assert total == pytest.approx(expected)


def test_each_worker_runs_blas_on_one_thread() -> None:
    if not any(pool["user_api"] == "blas" for pool in threadpool_info()):
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    with threadpool_limits(limits=2, user_api="blas"):  # a parent with a pool of 2
        found = map_heads(_case(), _blas_threads, HEADS, workers=2)
    assert all(threads == [1] * len(threads) and threads for threads in found), found


def test_units_share_a_kv_head_only_while_every_worker_gets_one() -> None:
    case = _case()  # B = 2, Hq = 4, Hkv = 2: groups (0, 1) and (2, 3)
    assert work_units(case, HEADS, 8) == [(b, (h,)) for b, h in HEADS]
    assert work_units(case, HEADS, 4) == [(b, g) for b in range(2) for g in ((0, 1), (2, 3))]
    assert work_units(case, HEADS, 1) == work_units(case, HEADS, 4)  # never across kv heads
    gap = [(0, 0), (0, 2), (0, 3)]  # head 1 has nothing to do: 0 and 2 are not one run
    assert work_units(case, gap, 1) == [(0, (0,)), (0, (2, 3))]
    unit = unit_case(case, 1, (2, 3))
    assert (unit.B, unit.Hq, unit.Hkv) == (1, 2, 1)
    assert np.array_equal(unit.q, case.q[1:2, :, 2:4]) and np.array_equal(
        unit.k, case.k[1:2, :, 1:2]
    )
    with pytest.raises(ValueError, match="one kv head"):
        unit_case(case, 0, (1, 2))


@pytest.mark.parametrize("parallel", [False, True], ids=["here", "forked"])
def test_references_by_units_equal_the_whole_case_tiers(parallel, monkeypatch) -> None:
    """CaseReferences computes exact, streaming and bounds per unit and reassembles them by
    head: the result must be the tiers' own on the whole case (a slip in a unit's head slice
    would mix up the heads of a GQA group)."""
    from attention_crossval.kernel.harness import references
    from attention_crossval.reference.bounds import error_bound, lse_error_bound
    from attention_crossval.reference.exact import exact_attention
    from attention_crossval.reference.precision import StreamingPrecision
    from attention_crossval.reference.streaming import streaming_attention
    from attention_crossval.report.configs import Config

    if parallel:  # every case takes the forked path, on two workers: units of two heads
        monkeypatch.setattr(references, "PARALLEL_KEYS", 1)
        monkeypatch.setattr("os.cpu_count", lambda: 2)
    case = Config("bfloat16", 64, 40, 200, B=2, Hq=4, Hkv=2, mask="causal", seed=3).build()
    refs = references.CaseReferences(case, rows=6, tile_m=64, tile_n=64)
    precision = StreamingPrecision(p_dtype="bfloat16")
    exact, rows = refs.exact(), refs.sampled_rows()
    whole = exact_attention(case, rows=rows, prec_bits=refs.prec_bits)
    np.testing.assert_array_equal(exact.o, whole.o)
    np.testing.assert_array_equal(exact.o_err_bound, whole.o_err_bound)
    np.testing.assert_array_equal(exact.lse, whole.lse)
    result, trace = refs.streaming(precision, 64, 64)
    np.testing.assert_array_equal(
        result.o, streaming_attention(case, precision, block_m=64, block_n=64).o
    )
    assert trace(1, 3, 39)[1] == 4  # blocks of 64 keys a bottom-right causal last row sees
    bound, lse_bound = refs.bounds(precision, 64)
    reference = refs.float64()
    np.testing.assert_array_equal(bound, error_bound(case, reference, precision, block_n=64))
    np.testing.assert_array_equal(
        lse_bound, lse_error_bound(case, reference, precision, block_n=64)
    )
