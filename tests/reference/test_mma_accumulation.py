"""The FP8 MMA's narrow accumulator (docs/fp8.md#mma-accumulation): the chain's fields and their
validation, the emulation of one MMA step (reference/mma.py), the streaming tier with the field
set inside its bound of exact on the FP8 strategies, and the field being needed: a truncating
chain breaks the bound derived for fp32 accumulation, and a kernel that keeps fewer bits than it
declares breaks its own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import FP8_DTYPES
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.mma import aligned_sum, mma_product
from attention_crossval.reference.precision import HOPPER_FP8_MMA_BITS, StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.report.repro_case import chain_words
from attention_crossval.testing.broken.triton_fp8 import creep_case

pytestmark = pytest.mark.cpu

FP8_SPEC = dataclasses.replace(
    REFERENCE_SPEC, name="reference-fp8", dtypes=frozenset(FP8_DTYPES), descales=True
)
# The fixed constants per format (docs/fp8.md#the-chain): P never clamps.
CONSTANTS = {"float8_e4m3fn": (4.0, 4.0), "float8_e5m2": (8.0, 4.0)}


def _chain(dtype: str = "float8_e4m3fn", **fields) -> StreamingPrecision:
    offset, threshold = CONSTANTS[dtype]
    chain = StreamingPrecision.fp8_attention(
        dtype, max_offset_log2=offset, rescale_threshold_log2=threshold
    )
    return dataclasses.replace(chain, **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mma_accumulator_bits": 3}, r"mma_accumulator_bits=3 must be None or an int in \[4, "),
        ({"mma_accumulator_bits": 25}, r"mma_accumulator_bits=25 must be None or an int"),
        ({"mma_accumulator_bits": True}, r"mma_accumulator_bits=True must be None or an int"),
        ({"mma_accumulator_bits": 14.0}, r"mma_accumulator_bits=14.0 must be None or an int"),
        ({"mma_accumulator_rounding": "up"}, r"mma_accumulator_rounding='up' must be one of"),
        ({"mma_promotion_interval": 32}, "mma_promotion_interval=32 needs mma_accumulator_bits"),
        (
            {"mma_accumulator_bits": 14, "mma_promotion_interval": 0},
            r"mma_promotion_interval=0 must be None or an int >= 1",
        ),
        (
            {"mma_accumulator_bits": 14, "p_dtype": "bfloat16"},
            "mma_accumulator_bits=14 models an FP8 MMA: it needs an FP8 p_dtype",
        ),
        (
            {"mma_accumulator_bits": 14, "accum_dtype": "float64"},
            "it needs an FP8 p_dtype and float32 scores and accumulators",
        ),
    ],
)
def test_bad_mma_accumulator_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        _chain(**fields)


def test_the_chain_carries_the_accumulator_into_its_words():
    chain = _chain(mma_accumulator_bits=14, mma_promotion_interval=32)
    assert "mma_accumulator_bits=14" in repr(chain)
    assert "14-bit accumulator (truncate, promoted every 32 products)" in chain_words(chain)
    assert "FP8 MMA" not in chain_words(_chain())


def test_one_step_cuts_every_term_on_the_largest_ones_grid():
    """8 bits under a largest term of 2^10: the grid is 2^3, so each 7 loses its low bits (to 0
    truncating, to +-8 to nearest), 12 keeps 8; a sum of 9 bits is cut to 8 again."""
    terms = np.array([[[1024.0], [7.0], [-7.0], [7.0]]])
    assert aligned_sum(terms, 8, truncate=True)[0, 0] == 1024.0
    assert aligned_sum(terms, 8, truncate=False)[0, 0] == 1024.0 + 8.0
    assert aligned_sum(np.array([[[1024.0], [12.0]]]), 8, truncate=True)[0, 0] == 1032.0
    assert aligned_sum(np.array([[[1024.0], [1024.0], [8.0]]]), 8, truncate=True)[0, 0] == 2048.0


@pytest.mark.parametrize("interval", [None, 1, 32, 48])
def test_24_bits_to_nearest_is_the_exact_sum_of_small_integers(interval):
    rng = np.random.default_rng(0)
    a, b = rng.integers(-8, 9, (5, 100)).astype(float), rng.integers(-8, 9, (100, 3)).astype(float)
    chain = _chain(
        mma_accumulator_bits=24, mma_accumulator_rounding="nearest", mma_promotion_interval=interval
    )
    start = np.full((5, 3), 0.5, np.float32)
    assert np.array_equal(mma_product(a, b, chain, initial=start), start + a @ b)


@settings(max_examples=30, deadline=None)
@given(
    attention_cases(
        spec=FP8_SPEC, max_len=5 * FP8_SPEC.tile_n + 1, features=("hidden", "varlen_batch")
    ),
    st.data(),
)
def test_narrow_accumulator_chain_stays_within_its_bound_of_exact(case, data):
    """(a) The streaming tier with the FP8 MMA's narrow accumulator, promoted every few
    products or never, truncating or to nearest, on the default FP8 strategies (every
    distribution, the creeping ramp, descales honest and adversarial): O and LSE within the
    bound derived for that chain."""
    chain = _chain(
        case.dtype,
        mma_accumulator_bits=data.draw(st.sampled_from([HOPPER_FP8_MMA_BITS, 8])),
        mma_accumulator_rounding=data.draw(st.sampled_from(["truncate", "nearest"])),
        mma_promotion_interval=data.draw(st.sampled_from([None, 4, 32])),
        row_sum_from_rounded_p=data.draw(st.booleans()),
    )
    block_n = data.draw(st.sampled_from([4, FP8_SPEC.tile_n]))
    exact = exact_attention(case).as_result()
    result = streaming_attention(case, chain, block_n=block_n)
    bound = error_bound(case, exact, chain, block_n=block_n)
    lse_bound = lse_error_bound(case, exact, chain, block_n=block_n)
    assert_within_bound(result, exact, bound, output_dtype=case.out_dtype, lse_bound=lse_bound)


def _lse_error_over_bound(case, runs: StreamingPrecision, declared: StreamingPrecision):
    exact = exact_attention(case).as_result()
    result = streaming_attention(case, runs, block_n=64)
    bound = lse_error_bound(case, exact, declared, block_n=64)
    return float(np.max(np.abs(result.lse - exact.lse) / bound))


@pytest.mark.parametrize("interval", [None, 32])
def test_the_fp32_bound_does_not_hold_for_a_truncating_accumulator(interval):
    """(b) The field is needed: on the creeping ramp (one large product per score) Hopper's
    14-bit truncating accumulator moves the LSE beyond the bound of fp32 accumulation, and
    stays inside the bound of the chain that declares it."""
    case = creep_case(Sq=8, Sk=256, D=32, Hq=1)
    hopper = _chain(mma_accumulator_bits=HOPPER_FP8_MMA_BITS, mma_promotion_interval=interval)
    fp32 = _chain()
    assert _lse_error_over_bound(case, hopper, fp32) > 2
    assert _lse_error_over_bound(case, hopper, hopper) < 0.1


def test_a_kernel_keeping_fewer_bits_than_it_declares_breaks_its_bound():
    """A kernel whose accumulator keeps 6 bits while it declares Hopper's 14 is caught."""
    case = creep_case(Sq=8, Sk=256, D=32, Hq=1)
    declared = _chain(mma_accumulator_bits=HOPPER_FP8_MMA_BITS, mma_promotion_interval=32)
    runs = dataclasses.replace(declared, mma_accumulator_bits=6)
    assert _lse_error_over_bound(case, runs, declared) > 1
