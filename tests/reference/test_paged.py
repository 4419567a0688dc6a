"""Paged KV (reference/paged.py): the layout a paged kernel gets, and the streaming tier
reading through the page table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import find as hypothesis_find
from hypothesis import given, settings
from hypothesis.errors import NoSuchExample

from attention_crossval.properties._strategies.paged import paged_cases
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.paged import page_kv, paged_attention, read_pages
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.testing.mutants_surface import load_surface_mutant

pytestmark = pytest.mark.cpu

TILE_N = REFERENCE_SPEC.tile_n
PAGED_CASES = paged_cases(attention_cases(max_batch=3), tile_n=TILE_N)
FLOAT64 = StreamingPrecision.float64()


def _nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(x.astype(np.float32))


@given(PAGED_CASES)
def test_the_layout_holds_every_valid_key_and_poison_elsewhere(run) -> None:
    case, paged = run
    P = paged.page_size
    reachable = np.zeros(len(paged.k_pages), dtype=bool)
    for b, n in enumerate(paged.k_lengths):
        k, v = read_pages(paged, b, np.arange(n))
        assert np.array_equal(k, case.k[b, :n]) and np.array_equal(v, case.v[b, :n])
        used = paged.page_table[b, : -(-n // P)]
        reachable[used] = True
        assert _nan(paged.k_pages[paged.page_table[b, -(-n // P) :]]).all()  # past its pages
        if n % P:  # the partly filled last page: its tail is poison
            assert _nan(paged.k_pages[used[-1], n % P :]).all()
    assert _nan(paged.k_pages[~reachable]).all() and (~reachable).any()
    assert paged.page_table.shape == (case.B, max(1, -(-case.Sk // P)))


def test_pages_are_shuffled_and_a_common_prefix_is_shared() -> None:
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((2, 20, 1, 4)).astype(np.float16) for _ in range(2))
    k[1, :12], v[1, :12] = k[0, :12], v[0, :12]  # three whole pages of 4 in common
    q = rng.standard_normal((2, 3, 1, 4)).astype(np.float16)
    case = AttentionCase(q, k, v, mask=Mask(k_lengths=(20, 17)))
    paged = page_kv(case, 4, seed=3)
    assert paged.shared_pages == 3
    assert len(paged.k_pages) == 5 + 2 + 1  # batch 0: 5 pages; batch 1: 2 of its own; 1 spare
    assert not np.array_equal(paged.page_table[0], np.arange(5))


@given(PAGED_CASES)
def test_attention_through_the_page_table_is_the_plain_streaming_tier(run) -> None:
    case, paged = run
    with np.errstate(all="ignore"):
        plain = streaming_attention(case, block_m=16, block_n=TILE_N)
        through = paged_attention(case, paged, block_m=16, block_n=TILE_N)
    assert np.array_equal(plain.o, through.o) and np.array_equal(plain.lse, through.lse)


def test_the_strategy_catches_a_page_lookup_off_by_one() -> None:
    mutant = load_surface_mutant("page_lookup_off_by_one").paged_attention

    def fails(run) -> bool:
        case, paged = run
        with np.errstate(all="ignore"):
            got = mutant(case, paged, FLOAT64, block_m=16, block_n=TILE_N)
            exact = exact_attention(case).as_result()
            bound = error_bound(case, exact, FLOAT64, block_n=TILE_N)
            lse_bound = lse_error_bound(case, exact, FLOAT64, block_n=TILE_N)
            try:
                assert_within_bound(got, exact, bound, output_dtype="float64", lse_bound=lse_bound)
            except AssertionError:
                return True
        return False

    try:
        hypothesis_find(PAGED_CASES, fails, settings=settings(max_examples=60, database=None))
    except NoSuchExample:
        pytest.fail("page_lookup_off_by_one survived 60 paged cases")


def test_invalid_arguments() -> None:
    case = AttentionCase(*(np.zeros((1, 2, 1, 2), np.float16) for _ in range(3)))
    with pytest.raises(ValueError, match="page_size"):
        page_kv(case, 0)
    with pytest.raises(ValueError, match="extra_pages"):
        page_kv(case, 2, extra_pages=0)
    other = AttentionCase(case.q, case.k, case.v, mask=Mask(k_lengths=(1,)))
    with pytest.raises(ValueError, match="k_lengths"):
        paged_attention(other, page_kv(case, 2))
