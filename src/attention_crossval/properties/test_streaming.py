"""Properties of the streaming tier (reference/streaming.py): agreement with the exact tier,
block/order independence, the rescale trace, emulated precisions, empty rows, padding.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention_crossval.properties.strategies import DISTRIBUTIONS, attention_cases
from attention_crossval.reference import bounds as reference_bounds
from attention_crossval.reference import precision as reference_precision
from attention_crossval.reference import streaming as reference_streaming
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.masks import empty_rows
from attention_crossval.reference.precision import StreamingPrecision, cast_input, round_to
from attention_crossval.reference.streaming import RescaleTrace, streaming_attention

pytestmark = pytest.mark.cpu

FLOAT64 = StreamingPrecision.float64()


# 'huge' and 'below_sentinel' put scores at |s| ~ 1e3..1e5, where float64 rounding of the exp2
# argument alone is ~|s| 2^-53 relative: those cases are held to the derived bound
# (properties/test_bounds.py), not to 1e-12 here.
BENIGN = tuple(name for name in DISTRIBUTIONS if name not in ("huge", "below_sentinel"))
all_cases = attention_cases(max_len=20)
benign_cases = attention_cases(max_len=20, distributions=BENIGN)
blocks = st.tuples(st.integers(1, 16), st.integers(1, 16))


def max_abs_v(case: AttentionCase) -> float:
    """max |V| over finite entries (padding may hold NaN/Inf), at least 1."""
    v = case.v.astype(np.float64)
    return max(1.0, float(np.abs(v[np.isfinite(v)]).max(initial=0)))


def assert_matches_reference(result, case: AttentionCase, rel: float = 1e-12) -> None:
    """Agreement with the exact tier: O within ``rel * max|V|`` (O is a convex combination of V
    rows), LSE within ``rel * max(1, |lse|)``, and the same empty rows (-inf) on both sides."""
    exact = exact_attention(case)
    o_ref, lse_ref = exact.o, exact.lse
    v_max = max_abs_v(case)
    np.testing.assert_allclose(result.o, o_ref, rtol=0, atol=rel * v_max)
    assert np.array_equal(np.isneginf(result.lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(
        result.lse[finite],
        lse_ref[finite],
        rtol=rel,
        atol=rel * np.abs(lse_ref[finite]).max(initial=1),
    )


@given(benign_cases, blocks, st.booleans())
def test_float64_matches_exact_tier(case, block, reverse):
    result = streaming_attention(case, block_m=block[0], block_n=block[1], reverse_kv_order=reverse)
    assert np.isfinite(result.o).all()
    assert_matches_reference(result, case)


def assert_same_float64_result(got, ref, case: AttentionCase, rel: float = 1e-12) -> None:
    """Two float64-mode results: O within ``rel * max|V|``, LSE within ``rel * max(1, |lse|)``."""
    np.testing.assert_allclose(got.o, ref.o, rtol=0, atol=rel * max_abs_v(case))
    assert np.array_equal(np.isneginf(got.lse), np.isneginf(ref.lse))
    finite = np.isfinite(ref.lse)
    lse_scale = np.abs(ref.lse[finite]).max(initial=1)
    np.testing.assert_allclose(got.lse[finite], ref.lse[finite], rtol=0, atol=rel * lse_scale)


@given(benign_cases, blocks, blocks)
def test_float64_independent_of_blocks_and_kv_order(case, block_a, block_b):
    a = streaming_attention(case, block_m=block_a[0], block_n=block_a[1])
    b = streaming_attention(case, block_m=block_b[0], block_n=block_b[1], reverse_kv_order=True)
    assert_same_float64_result(b, a, case)


def ramp_case(Sk: int, softmax_scale: float) -> AttentionCase:
    """Score of key j is ``j * softmax_scale`` for every row: each K block sets a new max."""
    q = np.ones((1, 3, 1, 2), np.float32)
    k = np.zeros((1, Sk, 1, 2), np.float32)
    k[0, :, 0, 0] = np.arange(Sk)
    v = np.random.default_rng(0).normal(size=(1, Sk, 1, 4)).astype(np.float32)
    return AttentionCase(q, k, v, softmax_scale=softmax_scale)


@pytest.mark.parametrize("Sk, block_n", [(64, 8), (65, 8), (7, 1), (5, 16)])
def test_ramp_rescales_once_per_block_after_the_first(Sk, block_n):
    case = ramp_case(Sk, softmax_scale=0.5)
    n_blocks = -(-Sk // block_n)
    forward, backward = RescaleTrace(), RescaleTrace()
    streaming_attention(case, block_n=block_n, trace=forward)
    streaming_attention(case, block_n=block_n, reverse_kv_order=True, trace=backward)
    assert (forward.rescales == n_blocks - 1).all()
    assert (forward.max_raises == n_blocks).all()
    assert (forward.visible_blocks == n_blocks).all()
    # Visited last-to-first, the first block already holds the max: never raised again.
    assert (backward.rescales == 0).all() and (backward.max_raises == 1).all()


def test_threshold_keeps_stale_max_on_a_gentle_ramp():
    # Each 8-key block raises the max by 8 * 0.05 * log2(e) ~ 0.58 log2 units, below 8.
    case, block_n = ramp_case(256, softmax_scale=0.05), 8
    n_blocks = 256 // block_n
    exact, stale = RescaleTrace(), RescaleTrace()
    ref = streaming_attention(case, block_n=block_n, trace=exact)
    precision = dataclasses.replace(FLOAT64, rescale_threshold_log2=8.0)
    got = streaming_attention(case, precision, block_n=block_n, trace=stale)
    np.testing.assert_allclose(got.o, ref.o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.lse, ref.lse, rtol=1e-12)
    assert (exact.rescales == n_blocks - 1).all()
    assert (0 < stale.rescales).all() and (stale.rescales < exact.rescales).all()
    # Every block raises the true max, so each is either a rescale or a skipped one.
    assert (stale.rescales + stale.skipped_rescales == n_blocks - 1).all()


@given(benign_cases, st.floats(0, 20), blocks)
def test_threshold_is_exact_and_only_drops_rescales(case, threshold, block):
    kwargs = dict(block_m=block[0], block_n=block[1])
    exact, stale = RescaleTrace(), RescaleTrace()
    ref = streaming_attention(case, **kwargs, trace=exact)
    precision = dataclasses.replace(FLOAT64, rescale_threshold_log2=threshold)
    got = streaming_attention(case, precision, **kwargs, trace=stale)
    # P <= 2^threshold under a stale max; the normalization uses the same max, so O and LSE
    # agree to rounding (relative to 2^threshold-scaled sums).
    np.testing.assert_allclose(
        got.o, ref.o, rtol=0, atol=1e-12 * max(1, np.abs(ref.o).max(initial=0))
    )
    np.testing.assert_allclose(got.lse, ref.lse, rtol=1e-12)
    # A raise under the threshold is a raise of the true max (the stale max is never more than
    # the threshold below it), and every true raise is a raise or a skip.
    assert (stale.rescales <= exact.rescales).all()
    assert (exact.rescales <= stale.rescales + stale.skipped_rescales).all()
    assert (exact.skipped_rescales == 0).all()
    assert np.array_equal(stale.visible_blocks, exact.visible_blocks)


@given(
    attention_cases(max_len=20, dtypes=("float16", "bfloat16")),
    st.booleans(),
    st.sampled_from([None, "float32", "input dtype"]),
    blocks,
)
def test_emulated_outputs_are_values_of_the_output_dtype(case, rounded_sum, output, block):
    output = case.dtype if output == "input dtype" else output
    precision = dataclasses.replace(
        StreamingPrecision.flash_attention(case.dtype),
        row_sum_from_rounded_p=rounded_sum,
        output_dtype=output,
    )
    result = streaming_attention(case, precision, block_m=block[0], block_n=block[1])
    assert np.array_equal(round_to(result.o, output or "float32"), result.o)
    assert np.array_equal(result.lse, result.lse.astype(np.float32))
    assert np.array_equal(np.isneginf(result.lse), empty_rows(case))
    assert np.isfinite(result.o).all() and not np.isnan(result.lse).any()


@pytest.mark.parametrize("p_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rounded_sum", [False, True])
def test_p_is_rounded_before_pv_and_row_sum_follows_the_knob(p_dtype, rounded_sum):
    # Two keys, scores 0 and -0.25 (scale 1), V = [0, 1]: O = P1 / (P0 + P1) with P0 = 1.
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.array([0.0, -0.25], np.float32).reshape(1, 2, 1, 1)
    v = np.array([0.0, 1.0], np.float32).reshape(1, 2, 1, 1)
    case = AttentionCase(q, k, v, softmax_scale=1.0)
    precision = StreamingPrecision(p_dtype=p_dtype, row_sum_from_rounded_p=rounded_sum)
    result = streaming_attention(case, precision, block_n=1)
    c = np.float32(np.log2(np.e))
    p1 = np.exp2(np.float32(-0.25) * c)  # exact product: -0.25 is a power of two
    p1_rounded = np.float32(round_to(p1, p_dtype))
    assert p1_rounded != p1  # the check below can tell the two apart
    row_sum = np.float32(1) + (p1_rounded if rounded_sum else p1)
    assert result.o[0, 0, 0, 0] == p1_rounded / row_sum


@pytest.mark.parametrize(
    "Sq, Sk, mask",
    [
        (9, 4, Mask(causal=True)),  # bottom-right causal, Sq > Sk: the first 5 rows see nothing
        (6, 6, Mask(k_lengths=(6, 0))),  # batch 1 has no keys
        (5, 7, Mask(explicit=np.repeat((np.arange(5) % 2 == 1)[None, None, :, None], 7, axis=3))),
        (6, 5, Mask(q_lengths=(3, 6), window_left=0, window_right=0, causal=True)),
    ],
)
@pytest.mark.parametrize("precision", [FLOAT64, StreamingPrecision.flash_attention("bfloat16")])
def test_empty_rows_give_zero_output_and_minus_inf_lse(Sq, Sk, mask, precision):
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, S, 2, 8)).astype(np.float16) for S in (Sq, Sk, Sk))
    case = AttentionCase(q, k, v, mask=mask)
    empty = empty_rows(case)
    assert empty.any()
    trace = RescaleTrace()
    result = streaming_attention(case, precision, block_m=2, block_n=3, trace=trace)
    assert np.isfinite(result.o).all() and not np.isnan(result.lse).any()
    assert (result.o.transpose(0, 2, 1, 3)[empty] == 0).all()
    assert np.array_equal(np.isneginf(result.lse), empty)
    assert np.array_equal(trace.visible_blocks == 0, empty)
    assert (trace.rescales[empty] == 0).all()


@given(
    attention_cases(max_len=20, distributions=["nonfinite_padding"]),
    blocks,
    st.sampled_from(["float64", "bfloat16", "float16"]),
)
def test_nan_in_padding_never_leaks(case, block, chain):
    """Padding holds NaN/Inf; with zeros there instead the results must be bit-identical."""
    precision = FLOAT64 if chain == "float64" else StreamingPrecision.flash_attention(chain)
    zeroed = AttentionCase(
        *(np.where(np.isfinite(x), x, 0) for x in (case.q, case.k, case.v)),
        case.softmax_scale,
        case.mask,
    )
    kwargs = dict(block_m=block[0], block_n=block[1])
    got, ref = (
        streaming_attention(case, precision, **kwargs),
        streaming_attention(zeroed, precision, **kwargs),
    )
    assert np.array_equal(got.o, ref.o) and np.array_equal(got.lse, ref.lse)
    assert np.isfinite(got.o).all()


@pytest.mark.parametrize(
    "Sq, Sk, block_m, block_n", [(15, 25, 8, 8), (16, 17, 16, 16), (1, 3, 4, 2)]
)
def test_partial_last_blocks(Sq, Sk, block_m, block_n):
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(1, S, 2, 8)).astype(np.float16) for S in (Sq, Sk, Sk))
    case = AttentionCase(q, k, v)
    trace = RescaleTrace()
    result = streaming_attention(case, block_m=block_m, block_n=block_n, trace=trace)
    assert_matches_reference(result, case)
    assert (trace.visible_blocks == -(-Sk // block_n)).all()


def test_memory_grows_with_blocks_not_with_sq_times_sk():
    rng = np.random.default_rng(3)
    S, D = 1024, 8
    q, k, v = (rng.normal(size=(1, S, 1, D)).astype(np.float16) for _ in range(3))
    case = AttentionCase(q, k, v)
    tracemalloc.start()
    try:
        streaming_attention(
            case, StreamingPrecision.flash_attention("float16"), block_m=32, block_n=32
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full_scores = S * S * 8  # one float64 score matrix
    assert peak < full_scores / 16, f"peak {peak} bytes vs {full_scores} for the full S"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_m=0),
        dict(block_n=2.5),
        dict(block_m=True),
        dict(precision="float32"),
        dict(trace=object()),
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    case = ramp_case(4, softmax_scale=1.0)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        streaming_attention(case, **kwargs)


def test_log_constants_are_defined_once_in_precision() -> None:
    for name in ("LOG2_E", "LN_2"):
        shared = getattr(reference_precision, name)
        assert getattr(reference_streaming, name) is shared, name
        assert getattr(reference_bounds, name) is shared, name
    assert reference_precision.LOG2_E * reference_precision.LN_2 == pytest.approx(1.0, rel=1e-15)


def test_cast_input_rounds_float64_to_bfloat16_once() -> None:
    """Case builders cast with ``cast_input``: one correct rounding whatever ml_dtypes does (before
    0.7 its float64 cast went through float32: these two ties broke the wrong way)."""
    x = np.array([1.33984374, 1 + 2.0**-8 + 2.0**-40, np.nan, 1e39, -3.0])
    cast = cast_input(x, "bfloat16")
    assert cast.dtype.name == "bfloat16"
    expected = [1.3359375, 1.0078125, np.nan, np.inf, -3.0]
    np.testing.assert_array_equal(cast.astype(np.float64), expected)
    assert cast_input(x, "float16").dtype == np.float16


def test_round_to_overflows_to_inf_without_a_warning() -> None:
    """fp16 outputs beyond 65504 are inf, as the kernel's would be; under ``filterwarnings =
    error`` the cast's overflow warning failed the backward bound property on V = +-1e4."""
    x = np.array([8e4, -8e4, 1.0], dtype=np.float32)
    assert list(round_to(x, "float16")) == [np.inf, -np.inf, 1.0]
    assert list(round_to(x.astype(np.float64), "bfloat16")) == [79872.0, -79872.0, 1.0]
