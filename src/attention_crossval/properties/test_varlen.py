"""Packed varlen (reference/varlen.py), batches of 3+ sequences with empty ones, decode
batches, long decode with GQA, and head dims up to 256 with Dv != D."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import find as hypothesis_find
from hypothesis import given, settings
from hypothesis.errors import NoSuchExample

from attention_crossval.properties._strategies.varlen import long_decode_cases, varlen_batches
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_shapes
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention, sample_rows
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.reference.varlen import PackedVarlen, cu_seqlens, pack, unpack_result

pytestmark = pytest.mark.cpu

BATCHES = varlen_batches(spec=REFERENCE_SPEC)
BLOCKS = dict(block_m=REFERENCE_SPEC.tile_m, block_n=REFERENCE_SPEC.tile_n)


def packed_streaming(case: AttentionCase, packed: PackedVarlen, overrun: int = 0):
    """A packed-varlen "kernel": each sequence's rows sliced out of the packed arrays by
    ``cu_seqlens`` and run alone; ``overrun`` > 0 reads that many keys past each sequence's end
    (into the next one), the offset bug this layout invites."""
    o = np.zeros((packed.q.shape[0], case.Hq, case.Dv))
    lse = np.full((case.Hq, packed.q.shape[0]), -np.inf)
    cu_q, cu_k = packed.cu_seqlens_q, packed.cu_seqlens_k
    for b in range(case.B):
        q = packed.q[cu_q[b] : cu_q[b + 1]][None]
        end = min(int(cu_k[b + 1]) + overrun, len(packed.k)) if cu_k[b + 1] > cu_k[b] else cu_k[b]
        k, v = (x[cu_k[b] : end][None] for x in (packed.k, packed.v))
        mask = dataclasses.replace(case.mask, q_lengths=None, k_lengths=None)
        one = AttentionCase(q, k, v, case.softmax_scale, mask)
        result = streaming_attention(one, **BLOCKS)
        o[cu_q[b] : cu_q[b + 1]] = result.o[0]
        lse[:, cu_q[b] : cu_q[b + 1]] = result.lse[0]
    return unpack_result(case, o, lse)


@given(BATCHES)
def test_batches_have_three_or_more_sequences_and_an_empty_one(case: AttentionCase) -> None:
    assert case.B >= 3 and 0 in case.mask.k_lengths
    if "decode" in case.label:
        assert max(case.mask.q_lengths) <= 1


@given(BATCHES)
def test_the_packed_layout_round_trips_through_a_packed_kernel(case: AttentionCase) -> None:
    """Slicing by cu_seqlens and unpacking gives bitwise the padded streaming tier's result."""
    packed = pack(case)
    assert packed.cu_seqlens_k[-1] == sum(case.mask.k_lengths) == len(packed.k)
    assert packed.max_seqlen_q == max(case.mask.q_lengths)
    with np.errstate(all="ignore"):
        padded = streaming_attention(case, **BLOCKS)
        through = packed_streaming(case, packed)
    assert np.array_equal(padded.o, through.o) and np.array_equal(padded.lse, through.lse)


def test_an_offset_overrun_is_found_on_batches_of_three() -> None:
    """Reading one key past a sequence's end changes some row (the next sequence's first key
    joins), found within 60 drawn batches."""

    def differs(case: AttentionCase) -> bool:
        with np.errstate(all="ignore"):
            padded = streaming_attention(case, **BLOCKS)
            broken = packed_streaming(case, pack(case), overrun=1)
        return not np.allclose(padded.o, broken.o, rtol=0, atol=1e-12)

    try:
        found = hypothesis_find(BATCHES, differs, settings=settings(max_examples=60, database=None))
    except NoSuchExample:
        pytest.fail("a one-key overrun survived 60 varlen batches")
    assert found.B >= 3


def test_cu_seqlens_and_unpack_validation() -> None:
    assert cu_seqlens([3, 0, 2]).tolist() == [0, 3, 3, 5]
    q = np.zeros((3, 4, 1, 2), np.float16)
    case = AttentionCase(q, q, q, mask=Mask(q_lengths=(2, 0, 4)))
    with pytest.raises(ValueError, match="total_q"):
        unpack_result(case, np.zeros((5, 1, 2)), None)
    with pytest.raises(ValueError, match="lse shape"):
        unpack_result(case, np.zeros((6, 1, 2)), np.zeros((6, 1)))


# Each case is one batch over >= 4096 keys: a few examples suffice to show the path works,
# and the exact tier samples 4 rows of it.
@settings(max_examples=4)
@given(long_decode_cases(spec=REFERENCE_SPEC))
def test_long_decode_with_gqa_stays_within_the_bound(case: AttentionCase) -> None:
    assert case.Sk >= 4096 and case.Sq <= 16 and case.group_size > 1
    precision = StreamingPrecision.flash_attention(case.dtype)
    with np.errstate(all="ignore"):
        got = streaming_attention(case, precision, **BLOCKS)
        exact = exact_attention(case, sample_rows(case, 4))
        bound = error_bound(case, exact.as_result(), precision, block_n=BLOCKS["block_n"])
        lse_bound = lse_error_bound(case, exact.as_result(), precision, block_n=BLOCKS["block_n"])
        assert_within_bound(got, exact, bound, output_dtype=case.dtype, lse_bound=lse_bound)


WIDE_SPEC = dataclasses.replace(
    REFERENCE_SPEC,
    head_dims=frozenset({32, 64, 96, 128, 192, 256}),
    head_dims_v=frozenset({64, 128, 192}),
)


@settings(max_examples=6)
@given(attention_shapes(spec=WIDE_SPEC, max_len=9))
def test_head_dims_to_256_with_dv_other_than_d(shape) -> None:
    """The strategies draw D and Dv separately from what a kernel declares; the tiers agree."""
    rng = np.random.default_rng(shape.D * 1000 + shape.Dv)
    q = rng.standard_normal((shape.B, shape.Sq, shape.Hq, shape.D)).astype(np.float16)
    k = rng.standard_normal((shape.B, shape.Sk, shape.Hkv, shape.D)).astype(np.float16)
    v = rng.standard_normal((shape.B, shape.Sk, shape.Hkv, shape.Dv)).astype(np.float16)
    case = AttentionCase(q, k, v, mask=Mask(causal=True))
    exact = exact_attention(case)
    got = streaming_attention(case, **BLOCKS)
    assert got.o.shape == exact.o.shape == (shape.B, shape.Sq, shape.Hq, shape.Dv)
    np.testing.assert_allclose(got.o, exact.o, rtol=0, atol=1e-12)


def test_wide_spec_reaches_dv_other_than_d() -> None:
    found = hypothesis_find(
        attention_shapes(spec=WIDE_SPEC, max_len=9),
        lambda s: s.D == 192 and s.Dv == 128,
        settings=settings(max_examples=500, database=None),
    )
    assert (found.D, found.Dv) == (192, 128)


def test_packed_kernel_result_type() -> None:
    q = np.zeros((3, 2, 1, 2), np.float16)
    case = AttentionCase(q, q, q, mask=Mask(q_lengths=(2, 0, 1), k_lengths=(2, 0, 1)))
    result = packed_streaming(case, pack(case))
    assert isinstance(result, AttentionResult) and np.isneginf(result.lse[1]).all()
