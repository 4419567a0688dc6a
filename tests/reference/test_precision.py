"""reference/precision.py: ``round_to`` with ``flush_subnormals`` (a flush-to-zero conversion,
which ``BackwardPrecision.ds_flushes_subnormals`` declares for dS)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attention_crossval.reference.precision import round_to

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_flush_zeroes_exactly_the_results_below_the_smallest_normal(dtype: str) -> None:
    """Subnormal results become zeros of their sign; the smallest normal, a value that rounds
    up to it, and every normal result are what plain rounding gives."""
    tiny = float(ml_dtypes.finfo(np.dtype(dtype)).smallest_normal)
    step = float(ml_dtypes.finfo(np.dtype(dtype)).smallest_subnormal)
    x = np.array([tiny, -tiny, tiny - step / 4, tiny - step, -step, step * 1.4, 0, 1.5, -3 * tiny])
    plain = round_to(x, dtype)
    flushed = round_to(x, dtype, flush_subnormals=True)
    subnormal = np.abs(plain) < tiny
    assert subnormal.tolist() == [False, False, False, True, True, True, True, False, False]
    np.testing.assert_array_equal(flushed[~subnormal], plain[~subnormal])
    assert np.all(flushed[subnormal] == 0)
    np.testing.assert_array_equal(np.signbit(flushed), np.signbit(plain))


def test_flush_keeps_inf_and_nan() -> None:
    out = round_to(np.array([np.inf, -np.inf, np.nan, 1e6]), "float16", flush_subnormals=True)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] == np.inf
