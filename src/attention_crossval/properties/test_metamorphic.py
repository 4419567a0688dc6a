"""Metamorphic and analytic properties (docs/design.md#properties) on the streaming tier.

Each test transforms a case so the exact answer changes in a known way (or not at all). The
transformed inputs stay exact values of their dtype, so any difference is the tier's rounding:
float64 mode is held to 1e-12 relative; transforms that leave every tile's arithmetic unchanged
(GQA head repetition, alignment when Sq == Sk) must agree bit for bit under any precision.
Block-size and K/V-order independence live in test_streaming.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import (
    INPUT_DTYPES,
    WIDE_DTYPES,
    AttentionCase,
    CausalAlignment,
    Mask,
)
from attention_crossval.reference.masks import visible_all
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention

pytestmark = pytest.mark.cpu

REL = 1e-12
PRECISIONS = [StreamingPrecision.float64(), StreamingPrecision.flash_attention("bfloat16")]


@dataclass(frozen=True)
class Shape:
    B: int
    Sq: int
    Sk: int
    Hkv: int
    group: int
    D: int
    Dv: int
    dtype: np.dtype
    rng: np.random.Generator

    def normal(self, S: int, H: int, D: int, sigma: float = 1.0) -> np.ndarray:
        """``[B, S, H, D]`` N(0, sigma^2) values rounded to the case dtype."""
        return self.rng.normal(0, sigma, (self.B, S, H, D)).astype(self.dtype)

    def integers(self, S: int, H: int, D: int, bound: int) -> np.ndarray:
        """Small integers: sums and products of a few stay exact in every input dtype."""
        return self.rng.integers(-bound, bound + 1, (self.B, S, H, D)).astype(self.dtype)


@st.composite
def shapes(draw, *, max_len: int = 12) -> Shape:
    """Shape parameters, dtype and a NumPy generator seeded from a drawn seed."""
    return Shape(
        B=draw(st.integers(1, 2)),
        Sq=draw(st.integers(1, max_len)),
        Sk=draw(st.integers(1, max_len)),
        Hkv=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 2)),
        D=draw(st.integers(1, 16)),
        Dv=draw(st.integers(1, 8)),
        dtype=INPUT_DTYPES[draw(st.sampled_from(sorted(WIDE_DTYPES)))],
        rng=np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
    )


@st.composite
def masks(draw, shape: Shape, *, causal: bool | None = None, explicit: bool = True) -> Mask:
    """Causal (either alignment), windows, k_lengths and explicit masks; no padded queries."""
    window = st.none() | st.integers(0, 5)
    return Mask(
        causal=draw(st.booleans()) if causal is None else causal,
        alignment=draw(st.sampled_from(CausalAlignment)),
        window_left=draw(window),
        window_right=draw(window),
        k_lengths=draw(st.none() | st.tuples(*[st.integers(0, shape.Sk)] * shape.B)),
        explicit=shape.rng.random((shape.B, 1, shape.Sq, shape.Sk)) < 0.7
        if explicit and draw(st.booleans())
        else None,
    )


blocks = st.tuples(st.integers(1, 8), st.integers(1, 8))


def attend(case: AttentionCase, block: tuple[int, int], precision=PRECISIONS[0]):
    return streaming_attention(case, precision, block_m=block[0], block_n=block[1])


def assert_close(actual: np.ndarray, expected: np.ndarray, scale: float) -> None:
    """Agreement to REL relative to ``scale`` (the largest magnitude O or LSE is built from)."""
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=REL * max(1.0, scale))


@given(shapes(), st.data(), blocks)
def test_shifting_a_rows_scores_changes_only_its_lse(shape, data, block):
    # An extra q column delta_i against an all-ones k column adds delta_i to every score of
    # row i: O is unchanged and LSE grows by softmax_scale * delta_i.
    q, k, v = (shape.normal(S, H, D) for S, H, D in _qkv_dims(shape))
    delta = shape.integers(shape.Sq, shape.Hkv * shape.group, 1, bound=40)
    ones = np.ones((shape.B, shape.Sk, shape.Hkv, 1), shape.dtype)
    mask, scale = data.draw(masks(shape)), 1 / np.sqrt(shape.D)
    base = attend(AttentionCase(q, k, v, scale, mask), block)
    shifted = attend(
        AttentionCase(np.concatenate([q, delta], 3), np.concatenate([k, ones], 3), v, scale, mask),
        block,
    )
    assert_close(shifted.o, base.o, np.abs(v.astype(float)).max())
    expected_lse = base.lse + scale * delta[..., 0].astype(float).transpose(0, 2, 1)
    assert_close(
        shifted.lse, expected_lse, np.abs(expected_lse[np.isfinite(expected_lse)]).max(initial=1)
    )


@given(shapes(), st.data(), blocks)
def test_permuting_keys_with_their_values_changes_nothing(shape, data, block):
    q, k, v = (shape.normal(S, H, D) for S, H, D in _qkv_dims(shape))
    explicit = data.draw(st.booleans())
    mask = Mask(explicit=shape.rng.random((1, 1, shape.Sq, shape.Sk)) < 0.7 if explicit else None)
    perm = shape.rng.permutation(shape.Sk)
    permuted_mask = Mask(explicit=mask.explicit[..., perm] if explicit else None)
    base = attend(AttentionCase(q, k, v, mask=mask), block)
    permuted = attend(AttentionCase(q, k[:, perm], v[:, perm], mask=permuted_mask), block)
    assert_close(permuted.o, base.o, np.abs(v.astype(float)).max())
    assert_close(permuted.lse, base.lse, np.abs(base.lse[np.isfinite(base.lse)]).max(initial=1))


@given(shapes(), st.data(), blocks, st.integers(-4, 4), st.integers(-4, 4))
def test_output_is_linear_in_v(shape, data, block, a, b):
    q, k = (shape.normal(S, H, D) for S, H, D in _qkv_dims(shape)[:2])
    v1, v2 = (shape.integers(shape.Sk, shape.Hkv, shape.Dv, bound=8) for _ in range(2))
    v12 = (a * v1.astype(float) + b * v2.astype(float)).astype(shape.dtype)  # |.| <= 64: exact
    mask = data.draw(masks(shape))
    o1, o2, o12 = (attend(AttentionCase(q, k, v, mask=mask), block).o for v in (v1, v2, v12))
    assert_close(o12, a * o1 + b * o2, 8 * (abs(a) + abs(b)))


@pytest.mark.parametrize("precision", PRECISIONS, ids=["float64", "bf16-chain"])
@given(attention_cases(max_len=16, max_heads=4), blocks)
def test_gqa_equals_repeated_kv_heads(precision, case, block):
    grouped = attend(case, block, precision)
    k_rep, v_rep = (np.repeat(x, case.group_size, axis=2) for x in (case.k, case.v))
    repeated = attend(
        AttentionCase(case.q, k_rep, v_rep, case.softmax_scale, case.mask), block, precision
    )
    assert np.array_equal(grouped.o, repeated.o) and np.array_equal(grouped.lse, repeated.lse)


@pytest.mark.parametrize("precision", PRECISIONS, ids=["float64", "bf16-chain"])
@given(shapes(), st.data(), blocks)
def test_causal_alignments_agree_when_sq_equals_sk(precision, shape, data, block):
    q, k, v = (shape.normal(shape.Sk, H, D) for _, H, D in _qkv_dims(shape))
    mask = data.draw(masks(shape, causal=True, explicit=False))
    lengths = mask.k_lengths
    results = [
        attend(
            AttentionCase(
                q, k, v, mask=dataclasses.replace(mask, alignment=alignment, q_lengths=lengths)
            ),
            block,
            precision,
        )
        for alignment in CausalAlignment
    ]
    assert np.array_equal(results[0].o, results[1].o)
    assert np.array_equal(results[0].lse, results[1].lse)


@given(shapes(), st.data(), blocks)
def test_decode_equals_last_row_of_prefill(shape, data, block):
    q, k, v = (shape.normal(S, H, D) for S, H, D in _qkv_dims(shape))
    mask = dataclasses.replace(
        data.draw(masks(shape, causal=True, explicit=False)), alignment=CausalAlignment.BOTTOM_RIGHT
    )
    prefill = attend(AttentionCase(q, k, v, mask=mask), block)
    decode = attend(AttentionCase(q[:, -1:], k, v, mask=mask), block)
    assert_close(decode.o[:, 0], prefill.o[:, -1], np.abs(v.astype(float)).max())
    lse_last = prefill.lse[..., -1]
    assert_close(
        decode.lse[..., 0], lse_last, np.abs(lse_last[np.isfinite(lse_last)]).max(initial=1)
    )


@given(shapes(), st.data(), blocks)
def test_equal_scores_give_the_mean_of_visible_values(shape, data, block):
    q, _, v = (shape.normal(S, H, D) for S, H, D in _qkv_dims(shape))
    key = shape.normal(1, shape.Hkv, shape.D)
    k = np.repeat(key, shape.Sk, axis=1)  # every key identical: one score per row
    case = AttentionCase(q, k, v, mask=data.draw(masks(shape)))
    result = attend(case, block)
    seen = visible_all(case)  # [B, Hq, Sq, Sk]
    count = seen.sum(-1)
    v_heads = np.repeat(v.astype(float), shape.group, axis=2)  # [B, Sk, Hq, Dv]
    mean = np.einsum("bhij,bjhd->bihd", seen / np.maximum(count, 1)[..., None], v_heads)
    assert_close(result.o, mean, np.abs(v.astype(float)).max())
    score = np.einsum(
        "bihd,bhd->bhi", q.astype(float), np.repeat(key[:, 0].astype(float), shape.group, 1)
    )
    with np.errstate(divide="ignore"):  # log(0) = -inf marks the empty rows
        expected_lse = score * case.softmax_scale + np.log(count)
    assert_close(result.lse, expected_lse, np.abs(expected_lse[count > 0]).max(initial=1))


@pytest.mark.parametrize("precision", PRECISIONS, ids=["float64", "bf16-chain"])
@given(shapes(), blocks)
def test_one_dominating_key_gives_its_value_row(precision, shape, block):
    # q in [0.5, 2], other keys in [-1, 1], the dominant key all 16: its score beats every other
    # by >= 7.5 D, so with scale 1 (and D >= 8) the other weights are below e^-60 of its own.
    D = max(shape.D, 8)
    q = (shape.rng.uniform(0.5, 2, (shape.B, shape.Sq, shape.Hkv * shape.group, D))).astype(
        shape.dtype
    )
    k = shape.rng.uniform(-1, 1, (shape.B, shape.Sk, shape.Hkv, D)).astype(shape.dtype)
    v = shape.normal(shape.Sk, shape.Hkv, shape.Dv)
    j = int(shape.rng.integers(shape.Sk))
    k[:, j] = 16
    result = attend(AttentionCase(q, k, v, softmax_scale=1.0), block, precision)
    v_j = v[:, j].astype(float)  # [B, Hkv, Dv]
    expected = np.repeat(v_j, shape.group, axis=1)[:, None]  # [B, 1, Hq, Dv]
    # The bf16 chain may land one bf16 spacing (<= 2^-7 relative) off: its max key's weight is
    # exp2 of the FMA residual S*c - fl(m*c), within an fp32 ulp of 1 but not 1, which can tip
    # an output rounding tie (falsifying example: Sq=Sk=1, v = -2.7109375 -> -2.703125).
    rtol = REL if precision.is_float64 else 2**-7
    np.testing.assert_allclose(
        result.o, np.broadcast_to(expected, result.o.shape), rtol=rtol, atol=0
    )


def _qkv_dims(shape: Shape) -> list[tuple[int, int, int]]:
    """(S, H, D) of q, k and v."""
    return [
        (shape.Sq, shape.Hkv * shape.group, shape.D),
        (shape.Sk, shape.Hkv, shape.D),
        (shape.Sk, shape.Hkv, shape.Dv),
    ]
