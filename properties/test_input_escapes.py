"""Regressions for inputs that escaped as tracebacks, hangs or garbage (issue 21, part C).

Each test names the escape it pins: non-native byte order, a sink far above every logit, a
saved case with out-of-range scalars, a precision chain with an infinite threshold, a dlse
spanning more than the float64 exponent range, and file names built from user text.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.exact import exact_attention, naive_exact_attention

pytestmark = pytest.mark.cpu


def _case(sink: float, **options) -> AttentionCase:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, s, 2, 8)).astype(np.float16) for s in (3, 5, 5))
    with np.errstate(over="ignore"):  # 1e39 becomes inf, which the case refuses
        sink_array = np.array([sink, 0.0], np.float32)
    return AttentionCase(q, k, v, mask=Mask(causal=True), sink=sink_array, **options)


# ---- a sink far above every logit ----------------------------------------------------------


@pytest.mark.parametrize("sink", [1e9, 1e12, 3e38, float(np.finfo(np.float32).max)])
def test_a_dominant_sink_is_handled_analytically_in_bounded_time(sink: float) -> None:
    """Escape: exp(sink - max logit) as a fixed-point integer took minutes at 1e9, raised
    MemoryError at 1e12 and OverflowError at 3e38. Now O = 0 and LSE = sink (the nearest
    doubles) with bound 2^-1074, in milliseconds."""
    case = _case(sink, softcap=30.0 if sink == 1e12 else None)
    start = time.perf_counter()
    exact = exact_attention(case)
    assert time.perf_counter() - start < 5.0
    assert (exact.o[:, :, 0] == 0).all() and (exact.o_lo[:, :, 0] == 0).all()
    assert (exact.lse[:, 0] == np.float32(sink)).all()
    assert (exact.o_err_bound[:, 0] == 2.0**-1074).all()
    assert (exact.lse_err_bound[:, 0] == 2.0**-1074).all()
    assert (exact.o[:, :, 1] != 0).any()  # the other head's sink (0) is an ordinary key


@pytest.mark.parametrize("sink", [-3e38, -float(np.finfo(np.float32).max)])
def test_a_sink_far_below_every_logit_weighs_nothing(sink: float) -> None:
    with_sink = _case(sink)
    without = AttentionCase(with_sink.q, with_sink.k, with_sink.v, mask=with_sink.mask)
    exact, reference = exact_attention(with_sink), exact_attention(without)
    np.testing.assert_array_equal(exact.o[:, :, 0], reference.o[:, :, 0])
    np.testing.assert_array_equal(exact.lse[:, 0], reference.lse[:, 0])


@pytest.mark.parametrize("margin", [820.0, 836.0, 845.0, 900.0])
def test_the_analytic_sink_gives_the_doubles_of_the_full_evaluation(margin: float) -> None:
    """Across the switch (about 835 above the largest logit for 5 keys) the exact tier agrees
    with the naive mpmath loop within its bound: the analytic branch returns the doubles the
    full evaluation rounds to."""
    probe = exact_attention(_case(0.0))
    top = float(np.nanmax(probe.lse[:, 0]))  # >= the largest logit of head 0
    case = _case(float(np.float32(top + margin)))
    exact, naive = exact_attention(case), naive_exact_attention(case, dps=400)
    allowed = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    assert np.all(np.abs(exact.o + exact.o_lo - naive.o) <= allowed + np.spacing(np.abs(naive.o)))
    assert np.all(np.abs(exact.lse - naive.lse) <= exact.lse_err_bound + np.spacing(np.abs(naive.lse)))


@pytest.mark.parametrize("sink", [math.inf, -math.inf, math.nan, 1e39])
def test_a_sink_outside_the_float32_range_is_refused(sink: float) -> None:
    with pytest.raises(ValueError, match="sink=.* must hold finite float32 values"):
        _case(sink)
