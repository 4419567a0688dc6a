"""Properties of the comparison engine (reference/compare.py) on hand-built results whose
metrics are known: ulps (subnormals included), double-double ties, -inf LSE, NaN, row masks."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention_crossval.reference.bounds import format_info
from attention_crossval.reference.case import AttentionResult
from attention_crossval.reference.compare import (
    assert_within_bound,
    compare,
    correctly_rounded,
    failure_message,
)
from attention_crossval.reference.exact import ExactResult

pytestmark = pytest.mark.cpu

SHAPE = (2, 3, 4, 5)  # B, Sq, Hq, Dv: all different, so a transposed index would show


def result(o: np.ndarray, lse: np.ndarray | None = None) -> AttentionResult:
    return AttentionResult(o=np.asarray(o, dtype=np.float64), lse=lse)


def exact(o, o_lo, lse=None, rows=None) -> ExactResult:
    B, Sq, Hq, _ = np.shape(o)
    lse = np.zeros((B, Hq, Sq)) if lse is None else lse
    return ExactResult(
        o=np.asarray(o, dtype=np.float64),
        o_lo=np.asarray(o_lo, dtype=np.float64),
        lse=lse,
        o_err_bound=np.zeros((B, Hq, Sq)),
        lse_err_bound=np.zeros((B, Hq, Sq)),
        rows=np.ones((B, Hq, Sq), bool) if rows is None else rows,
        prec_bits=128,
    )


def one(value: float) -> np.ndarray:
    return np.full((1, 1, 1, 1), value)


@pytest.mark.parametrize(
    ("dtype", "reference", "actual", "ulps"),
    [
        ("float16", 1.0, 1.0 + 2**-10, 1.0),
        ("float16", 1.0, 1.0 - 2**-11, 0.5),  # measured in the spacing of r's binade
        ("bfloat16", 1.0, 1.0 + 2**-7, 1.0),
        ("bfloat16", -3.0, -3.0 - 3 * 2**-6, 3.0),
        ("float32", 1.0, 1.0 + 2**-23, 1.0),
        ("float16", 3 * 2**-24, 2**-24, 2.0),  # fp16 subnormals: spacing 2^-24
        ("float16", 0.0, 2**-24, 1.0),
        ("float16", 2**-14, 2**-14 + 2**-24, 1.0),  # smallest normal: same spacing
        ("bfloat16", 5 * 2**-133, 4 * 2**-133, 1.0),  # bf16 subnormals: spacing 2^-133
        ("bfloat16", 0.0, -(2**-133), 1.0),
        ("float16", 1.0 + 2**-12, 1.0 + 2**-10, 1.0),  # vs the correctly rounded 1.0
    ],
)
def test_ulps_at_known_values(dtype: str, reference: float, actual: float, ulps: float) -> None:
    report = compare(result(one(actual)), result(one(reference)), bound=None, output_dtype=dtype)
    assert report.max_ulp == ulps
    assert report.max_abs == abs(actual - reference)
    assert report.worst_ulp == ulps


@pytest.mark.parametrize(
    ("lo", "nearest"),
    [(1e-30, 1 + 2**-10), (-1e-30, 1.0), (0.0, 1.0)],  # lo == 0: a true tie, to even
)
def test_fp16_tie_is_resolved_by_o_lo(lo: float, nearest: float) -> None:
    hi = 1 + 2**-11  # the midpoint of 1 and 1 + 2^-10 in fp16
    ref = exact(one(hi), one(lo))
    assert correctly_rounded(np.array(hi), np.array(lo), "float16") == nearest
    assert compare(result(one(nearest)), ref, bound=None, output_dtype="float16").max_ulp == 0
    other = 1 + 2**-10 if nearest == 1.0 else 1.0
    assert compare(result(one(other)), ref, bound=None, output_dtype="float16").max_ulp == 1


def test_bf16_subnormal_tie_is_resolved_by_o_lo() -> None:
    hi = 3 * 2**-134  # midpoint of 2^-133 and 2^-132 in bf16 subnormals
    assert correctly_rounded(np.array(hi), np.array(2.0**-200), "bfloat16") == 2**-132
    assert correctly_rounded(np.array(hi), np.array(-(2.0**-200)), "bfloat16") == 2**-133


@given(
    st.floats(-60000, 60000, allow_subnormal=True),
    st.floats(-1, 1),
    st.sampled_from(["float16", "bfloat16", "float32"]),
)
def test_correct_rounding_of_double_double(hi: float, lo_scale: float, dtype: str) -> None:
    """No representable neighbour is nearer to hi + lo (exact rational arithmetic) than the
    result, with lo below half a float64 ulp of hi as in a normalized double-double."""
    lo = lo_scale * float(np.spacing(abs(hi))) / 2
    got = correctly_rounded(np.array(hi), np.array(lo), dtype)
    native = format_info(dtype).dtype
    value = Fraction(hi) + Fraction(lo)
    for side in (np.inf, -np.inf):
        neighbour = np.nextafter(got.astype(native), np.array(side, native)).astype(np.float64)
        assert abs(Fraction(float(got)) - value) <= abs(Fraction(float(neighbour)) - value)


def test_lse_infinities() -> None:
    B, Sq, Hq, _ = SHAPE
    ref_lse = np.zeros((B, Hq, Sq))
    ref_lse[0, 0, 0] = -np.inf
    ref_lse[1, 1, 1] = -np.inf
    lse = ref_lse.copy()
    o = np.zeros(SHAPE)
    same = compare(
        result(o, lse), result(o, ref_lse), bound=np.zeros(SHAPE), output_dtype="float16"
    )
    assert same.lse_max_abs == 0 and same.lse_mismatched == 0 and same.passed
    lse[1, 1, 1] = 3.0  # a finite LSE for an empty row
    lse[0, 1, 2] = np.nan
    report = compare(result(o, lse), result(o, ref_lse), bound=None, output_dtype="float16")
    assert report.lse_max_abs == np.inf
    assert report.lse_mismatched == 2 and not report.passed
    lse[0, 1, 2] = 1e-3
    lse[1, 1, 1] = -np.inf
    bounded = compare(
        result(o, lse), result(o, ref_lse), bound=None, output_dtype="float16",
        lse_bound=np.full(lse.shape, 1e-4),
    )  # fmt: skip
    assert bounded.lse_max_abs == 1e-3 and bounded.lse_mismatched == 1


def test_nan_is_counted_and_always_mismatches() -> None:
    """NaN mismatches under any bound; inf only where the bound is finite (an infinite bound
    says the declared chain may overflow there), and NaN too where the chain is undefined."""
    ref = np.ones(SHAPE)
    actual = ref.copy()
    actual[1, 2, 3, 4] = np.nan
    actual[0, 0, 0, 0] = np.inf
    for bound, mismatched in ((None, 2), (np.full(SHAPE, 1.0), 2), (np.full(SHAPE, np.inf), 1)):
        report = compare(result(actual), result(ref), bound=bound, output_dtype="bfloat16")
        assert report.nonfinite == 2 and report.mismatched == mismatched and not report.passed
        assert report.max_abs == np.inf and report.max_ulp == np.inf
    assert report.total == ref.size
    undefined = np.zeros(SHAPE, bool)
    undefined[1, 2, 3, 4] = True
    report = compare(
        result(actual),
        result(ref),
        bound=np.full(SHAPE, np.inf),
        output_dtype="bfloat16",
        undefined=undefined,
    )
    assert report.mismatched == 0 and report.passed


def test_unevaluated_rows_are_excluded() -> None:
    B, Sq, Hq, Dv = SHAPE
    hi = np.ones(SHAPE)
    hi[0, 1, 2, :] = np.nan  # row (b=0, h=2, i=1) not evaluated: NaN reference
    rows = np.ones((B, Hq, Sq), bool)
    rows[1, 3, 2] = False  # ExactResult.rows False
    actual = np.full(SHAPE, 2.0)  # wrong everywhere ...
    actual[0, 1, 2, :] = 1.0
    selection = np.zeros((B, Hq, Sq), bool)
    selection[1, 3, 2] = selection[0, 2, 1] = selection[0, 0, 0] = True
    report = compare(
        result(actual), exact(hi, np.zeros(SHAPE), rows=rows), bound=np.full(SHAPE, 0.5),
        output_dtype="float32", rows=selection,
    )  # fmt: skip
    assert report.total == Dv  # only (b=0, h=0, i=0) survives all three exclusions
    assert report.mismatched == Dv and report.worst_index[:3] == (0, 0, 0)


def test_bound_fraction_and_worst_index() -> None:
    ref = np.full(SHAPE, 0.25)
    actual = ref.copy()
    bound = np.full(SHAPE, 1e-3)
    actual[1, 2, 3, 1] += 5e-4  # half the bound: the largest fraction
    actual[0, 1, 2, 3] += 4e-4
    bound[0, 1, 2, 3] = 1e-2  # larger abs error elsewhere would be 0.04 of its bound
    actual[1, 0, 0, 0] += 2e-3
    bound[1, 0, 0, 0] = 1e-1
    bound[0, 0, 1, 1] = 0.0  # zero bound, zero error: fraction 0
    report = compare(result(actual), result(ref), bound=bound, output_dtype="float32")
    assert report.worst_index == (1, 2, 3, 1)
    assert report.max_bound_fraction == pytest.approx(0.5)
    assert report.worst_bound == 1e-3 and report.worst_actual == actual[1, 2, 3, 1]
    assert report.max_abs == pytest.approx(2e-3) and report.passed
    actual[0, 0, 1, 1] += 2**-30
    tight = compare(result(actual), result(ref), bound=bound, output_dtype="float32")
    assert tight.max_bound_fraction == np.inf and tight.mismatched == 1
    assert tight.worst_index == (0, 0, 1, 1)


def test_relative_error_is_guarded_at_zero() -> None:
    ref, actual = np.zeros(SHAPE), np.zeros(SHAPE)
    actual[0, 0, 0, 0] = 2**-20
    report = compare(result(actual), result(ref), bound=None, output_dtype="float16")
    assert report.max_rel == 2**-20 / 2**-14  # relative to fp16's smallest normal
    assert report.max_ulp == 2**4  # 2^-20 in fp16 subnormal spacing 2^-24


def test_p99_ulp_ignores_the_last_percent() -> None:
    ref = np.ones((1, 100, 1, 2))
    actual = ref.copy()
    actual[0, 0, 0, 0] = 1 + 8 * 2**-10  # one outlier of 200 elements: 8 ulp
    actual[0, 1:, 0, 0] = 1 + 2**-10  # 99 elements: 1 ulp
    report = compare(result(actual), result(ref), bound=None, output_dtype="float16")
    assert report.max_ulp == 8 and report.p99_ulp == 1


def test_assert_within_bound_message_and_report() -> None:
    ref = np.full(SHAPE, 0.5)
    actual = ref.copy()
    actual[1, 2, 3, 4] = 0.5 + 3 * 2**-8  # 3 ulp of bf16 at 0.5
    bound = np.full(SHAPE, 2**-8)
    passed = assert_within_bound(result(ref), result(ref), bound, output_dtype="bfloat16")
    assert passed.passed and passed.mismatched == 0
    with pytest.raises(AssertionError) as info:
        assert_within_bound(
            result(actual), result(ref), bound, output_dtype="bfloat16",
            reproducer="pytest properties/test_x.py --case=/tmp/c.npz",
            streaming=result(np.full(SHAPE, 0.25)),
        )  # fmt: skip
    message = str(info.value)
    for fragment in (
        f"1 / {ref.size} elements (0.833%) mismatched",
        "(b, i, h, c) = (1, 2, 3, 4)",
        "3 ulp(bfloat16)",
        "= 3 x bound",
        "kernel 0.51171875 | reference 0.5 | bound 0.00391 | streaming 0.25",
        "reproduce: pytest properties/test_x.py --case=/tmp/c.npz",
    ):
        assert fragment in message, message
    assert failure_message(passed)  # a report formats even without a failure


def test_to_dict_round_trips_fields() -> None:
    report = compare(
        result(np.ones(SHAPE)), result(np.ones(SHAPE)), bound=None, output_dtype="float16"
    )
    out = report.to_dict()
    assert out["total"] == np.prod(SHAPE) and out["max_bound_fraction"] is None
    assert out["worst_index"] == [0, 0, 0, 0]


def test_lse_shape_error_names_the_argument_at_fault() -> None:
    B, Sq, Hq, _ = SHAPE
    o, good = np.zeros(SHAPE), np.zeros((B, Hq, Sq))
    with pytest.raises(ValueError, match=r"^reference\.lse shape"):
        compare(result(o, good), result(o, good[:, :, :1]), bound=None, output_dtype="float16")
    with pytest.raises(ValueError, match=r"^actual\.lse shape"):
        compare(result(o, good[:1]), result(o, good), bound=None, output_dtype="float16")


@pytest.mark.parametrize("bad", [np.nan, -1.0])
def test_nan_or_negative_bound_is_rejected_not_passed(bad: float) -> None:
    B, Sq, Hq, _ = SHAPE
    ref, actual = np.zeros(SHAPE), np.zeros(SHAPE)
    actual[0, 0, 0, 0] = 5.0
    bound = np.ones(SHAPE)
    bound[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"bound .*NaN or negative"):
        compare(result(actual), result(ref), bound=bound, output_dtype="float32")
    rows = np.ones((B, Hq, Sq), bool)
    rows[0, 0, 0] = False  # a bad bound on an element that is not evaluated is ignored
    report = compare(result(actual), result(ref), bound=bound, output_dtype="float32", rows=rows)
    assert report.passed and report.total == ref.size - SHAPE[3]
    lse, lse_bound = np.zeros((B, Hq, Sq)), np.zeros((B, Hq, Sq))
    lse[0, 0, 0], lse_bound[0, 0, 0] = 5.0, bad
    with pytest.raises(ValueError, match=r"lse_bound .*NaN or negative"):
        compare(
            result(ref, lse), result(ref, np.zeros((B, Hq, Sq))), bound=None,
            output_dtype="float32", lse_bound=lse_bound,
        )  # fmt: skip
    inf_bound = np.full(SHAPE, np.inf)  # allowed: an infinite bound passes any finite error
    assert compare(result(actual), result(ref), bound=inf_bound, output_dtype="float32").passed


def test_vacuous_bounds_are_counted_and_reported() -> None:
    B, Sq, Hq, _ = SHAPE
    ref = np.zeros(SHAPE)
    bound = np.full(SHAPE, 0.1)
    bound[0, 0, 0, :] = np.inf  # row (b=0, h=0, i=0): inf everywhere
    bound[1, 2, 3, 1] = 2.0  # >= its row's V range
    v_range = np.ones((B, Hq, Sq))
    v_range[1, 1, 1] = 0.0  # one visible value: no range to compare with, not counted
    bound[1, 1, 1, :] = 5.0
    report = compare(result(ref), result(ref), bound=bound, output_dtype="float32", v_range=v_range)
    assert report.vacuous == SHAPE[3] + 1 and report.passed
    assert f"vacuous bound on {SHAPE[3] + 1}/{report.total}" in report.summary()
    assert report.to_dict()["vacuous"] == SHAPE[3] + 1
    without_range = compare(result(ref), result(ref), bound=bound, output_dtype="float32")
    assert without_range.vacuous == SHAPE[3] and "vacuous" in without_range.summary()
    tight = compare(result(ref), result(ref), bound=np.full(SHAPE, 0.1), output_dtype="float32")
    assert tight.vacuous == 0 and "vacuous" not in tight.summary()
    with pytest.raises(ValueError, match="v_range shape"):
        compare(result(ref), result(ref), bound=bound, output_dtype="float32", v_range=v_range[0])
