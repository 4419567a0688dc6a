"""Split-KV emulation (reference/splitkv.py): partial O and LSE per split, then the combine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import find as hypothesis_find
from hypothesis import given, settings
from hypothesis.errors import NoSuchExample

from attention_crossval.properties._strategies.splits import num_splits_of, splitkv_cases
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.splitkv import combine, split_blocks, splitkv_attention
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.testing.mutants_surface import (
    load_surface_mutant,
    surface_reference_cases,
)

pytestmark = pytest.mark.cpu

TILE_N = REFERENCE_SPEC.tile_n
SPLIT_CASES = splitkv_cases(attention_cases(), tile_n=TILE_N)
SINKS = ("sink", "sink_dominant", "sink_below", "softcap+sink")
SPLIT_SINK_CASES = splitkv_cases(surface_reference_cases(SINKS), tile_n=TILE_N)


def _agreement(attention, case: AttentionCase, precision: StreamingPrecision) -> None:
    """Split-KV ``attention`` against the exact tier within the bound with ``num_splits``."""
    num_splits = num_splits_of(case)
    with np.errstate(all="ignore"):
        got = attention(case, precision, block_m=16, block_n=TILE_N, num_splits=num_splits)
        exact = exact_attention(case)
        kwargs = dict(block_n=TILE_N, num_splits=num_splits)
        bound = error_bound(case, exact.as_result(), precision, **kwargs)
        lse_bound = lse_error_bound(case, exact.as_result(), precision, **kwargs)
        output = precision.output_dtype or "float64"
        assert_within_bound(got, exact, bound, output_dtype=output, lse_bound=lse_bound)


def test_splits_take_whole_blocks_and_trailing_splits_may_be_empty() -> None:
    assert split_blocks(20, 8, 2) == [[slice(0, 8), slice(8, 16)], [slice(16, 20)]]
    assert split_blocks(20, 8, 5)[3:] == [[], []]
    assert split_blocks(0, 8, 3) == [[], [], []]
    assert split_blocks(17, 8, 1) == [[slice(0, 8), slice(8, 16), slice(16, 17)]]


def test_combine_of_empty_splits() -> None:
    """An empty split (LSE -inf, O 0) adds nothing; all splits empty give O = 0, LSE = -inf."""
    o_parts = np.array([[[2.0, -1.0]], [[0.0, 0.0]]])
    o, lse = combine(o_parts, np.array([[0.5], [-np.inf]]), np.dtype(np.float64))
    assert o.tolist() == [[2.0, -1.0]] and lse.tolist() == [0.5]
    o, lse = combine(np.zeros((3, 1, 2)), np.full((3, 1), -np.inf), np.dtype(np.float64))
    assert o.tolist() == [[0.0, 0.0]] and lse.tolist() == [-np.inf]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 9])
def test_one_split_is_the_plain_loop_and_more_agree_in_float64(num_splits: int) -> None:
    rng = np.random.default_rng(num_splits)
    q = rng.standard_normal((2, 5, 2, 8)).astype(np.float16)
    k, v = (rng.standard_normal((2, 41, 1, 8)).astype(np.float16) for _ in range(2))
    case = AttentionCase(q, k, v, mask=Mask(causal=True, k_lengths=(41, 9)))
    plain = streaming_attention(case, block_m=4, block_n=8)
    split = splitkv_attention(case, block_m=4, block_n=8, num_splits=num_splits)
    if num_splits == 1:
        assert np.array_equal(plain.o, split.o) and np.array_equal(plain.lse, split.lse)
    np.testing.assert_allclose(split.o, plain.o, rtol=0, atol=1e-14)
    np.testing.assert_allclose(split.lse, plain.lse, rtol=1e-14)


@given(SPLIT_CASES)
def test_split_kv_stays_within_the_derived_bound(case: AttentionCase) -> None:
    """Float64 and FlashAttention's chain (fp32 partials and combine) against the exact tier."""
    for precision in (StreamingPrecision.float64(), StreamingPrecision.flash_attention(case.dtype)):
        _agreement(splitkv_attention, case, precision)


@given(SPLIT_SINK_CASES)
def test_a_sink_enters_one_split_once(case: AttentionCase) -> None:
    """With a sink (and softcap) the split-and-combine still matches exact within the bound:
    counted in every split, the sink's weight would be num_splits times too large."""
    for precision in (StreamingPrecision.float64(), StreamingPrecision.flash_attention(case.dtype)):
        _agreement(splitkv_attention, case, precision)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("empty_split_lse_zero", SPLIT_CASES),
        ("combine_unguarded", SPLIT_CASES),
        ("sink_in_every_split", SPLIT_SINK_CASES),
    ],
)
def test_the_strategy_catches_a_broken_combine(name: str, strategy) -> None:
    """Each combine mutant fails the agreement property on some drawn case within 60."""
    mutant = load_surface_mutant(name).splitkv_attention

    def fails(case: AttentionCase) -> bool:
        try:
            _agreement(mutant, case, StreamingPrecision.float64())
        except AssertionError:
            return True
        return False

    try:
        found = hypothesis_find(strategy, fails, settings=settings(max_examples=60, database=None))
    except NoSuchExample:
        pytest.fail(f"{name} survived 60 split-KV cases")
    assert num_splits_of(found) >= 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(num_splits=0), "num_splits"), (dict(num_splits=True), "num_splits")],
)
def test_invalid_arguments(kwargs, match) -> None:
    case = AttentionCase(*(np.zeros((1, 2, 1, 2), np.float16) for _ in range(3)))
    with pytest.raises(ValueError, match=match):
        splitkv_attention(case, **kwargs)
    with pytest.raises(ValueError, match=match):
        error_bound(
            case, streaming_attention(case), StreamingPrecision.float64(), block_n=8, **kwargs
        )
