"""Properties of the exact tier (reference/exact.py): exactness, certified bounds, semantics."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpmath.libmp import from_man_exp, mpf_exp, mpf_sub, to_float
from mpmath.libmp.libelefun import exp_fixed, ln2_fixed

from attention_crossval.properties.exact_oracles import agrees_with_double, cases, dtype_values
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import WIDE_DTYPES, AttentionCase
from attention_crossval.reference.exact import (
    EXP_FIXED_ERROR_BOUND,
    dyadic_matmul,
    exact_attention,
    naive_exact_attention,
    sample_rows,
)
from attention_crossval.reference.masks import empty_rows, visible, visible_all

pytestmark = pytest.mark.cpu


# The project's adversarial distributions plus log-uniform values over whole exponent ranges.
_ALL_CASES = st.one_of(attention_cases(max_len=10, max_heads=2), cases())


@given(_ALL_CASES)
def test_exact_matches_naive_loop(case: AttentionCase) -> None:
    exact, naive = exact_attention(case), naive_exact_attention(case)
    o_bound = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    assert agrees_with_double(exact.o, exact.o_lo, o_bound, naive.o).all()
    finite = np.isfinite(naive.lse)
    assert np.array_equal(finite, np.isfinite(exact.lse))
    assert np.all(exact.lse[~finite] == naive.lse[~finite])
    # The LSE's error is absolute (fixed-point weights), e.g. ln(1 + e^-98.5) comes back as 0.
    lse_gap = np.abs(exact.lse[finite] - naive.lse[finite])
    allowed = exact.lse_err_bound[finite] + np.spacing(np.abs(naive.lse[finite]))
    assert np.all(lse_gap <= allowed)


@given(st.one_of(attention_cases(max_len=6, max_heads=2), cases(max_len=6)))
def test_certified_bound_holds_and_is_tiny(case: AttentionCase) -> None:
    """prec 128 against prec 512: the difference must fit in the sum of both bounds."""
    coarse, fine = exact_attention(case), exact_attention(case, prec_bits=512)
    gap = np.abs((coarse.o - fine.o) + (coarse.o_lo - fine.o_lo))
    allowed = (coarse.o_err_bound + fine.o_err_bound).transpose(0, 2, 1)[..., None]
    assert np.all(gap <= allowed)
    finite = np.isfinite(coarse.lse)
    lse_gap = np.abs(coarse.lse[finite] - fine.lse[finite])
    assert np.all(lse_gap <= (coarse.lse_err_bound + fine.lse_err_bound)[finite])
    vmax = np.nanmax(np.abs(case.v.astype(np.float64)), initial=0.0)
    assert np.all(coarse.o_err_bound <= 1e-25 * vmax + 1e-300)
    assert np.all(np.isfinite(coarse.lse_err_bound))


@given(st.sampled_from(list(WIDE_DTYPES)), st.sampled_from(["normal", "wide"]), st.integers(0))
def test_dyadic_matmul_equals_fraction_arithmetic(dtype: str, kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m, d = rng.integers(1, 6, size=3)
    a = dtype_values(rng, (n, d), dtype, kind).astype(np.float64)
    b = dtype_values(rng, (m, d), dtype, kind).astype(np.float64)
    ints, exponent = dyadic_matmul(a, b)
    for i in range(n):
        for j in range(m):
            expected = sum(
                Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a[i], b[j], strict=True)
            )
            assert Fraction(int(ints[i, j])) * Fraction(2) ** exponent == expected


def test_dyadic_matmul_is_exact_at_width_limits() -> None:
    """Long dot products of full-width fp32 values: every limb sum must stay below 2^53."""
    rng = np.random.default_rng(7)
    a = dtype_values(rng, (3, 256), "float32", "wide").astype(np.float64)
    b = dtype_values(rng, (4, 256), "float32", "wide").astype(np.float64)
    ints, exponent = dyadic_matmul(a, b)
    for i in range(3):
        expected = sum(
            Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a[i], b[1], strict=True)
        )
        assert Fraction(int(ints[i, 1])) * Fraction(2) ** exponent == expected


@given(_ALL_CASES)
def test_empty_rows_give_zero_output_and_minus_inf_lse(case: AttentionCase) -> None:
    exact = exact_attention(case)
    empty = empty_rows(case)
    assert np.all(exact.lse[empty] == -np.inf)
    assert np.all(exact.o.transpose(0, 2, 1, 3)[empty] == 0.0)
    assert np.all(exact.o_err_bound[empty] == 0.0) and np.all(exact.lse_err_bound[empty] == 0.0)
    assert np.isfinite(exact.o).all() and np.isfinite(exact.lse[~empty]).all()


@given(_ALL_CASES, st.integers(0))
def test_keys_hidden_by_the_mask_are_never_read(case: AttentionCase, seed: int) -> None:
    """Replacing the keys/values one row cannot see by huge values (keys that would dominate if
    the mask leaked) leaves that row unchanged, while every other row is evaluated alongside."""
    rng = np.random.default_rng(seed)
    b, h, i = (int(rng.integers(n)) for n in (case.B, case.Hq, case.Sq))
    hidden = ~visible(case, b, h, rows=np.array([i]))[0] & (np.arange(case.Sk) < case.k_length(b))
    k, v = case.k.copy(), case.v.copy()
    big = {"float16": 60000.0, "bfloat16": 1e30, "float32": 1e30}[case.dtype]
    k[b, hidden, case.kv_head(h)] = big * np.sign(np.nan_to_num(case.q[b, i, h].astype(float)))
    v[b, hidden, case.kv_head(h)] = -big
    altered = AttentionCase(case.q, k, v, case.softmax_scale, case.mask, "hidden keys replaced")
    first, second = exact_attention(case), exact_attention(altered)
    assert np.array_equal(first.o[b, i, h], second.o[b, i, h])
    assert np.array_equal(first.lse[b, h, i], second.lse[b, h, i])


@given(cases(dtypes=("float16",)))
def test_gqa_equals_repeated_kv_heads(case: AttentionCase) -> None:
    # The glossary's convention, spelled out independently of case.kv_head: h reads h // group.
    k, v = (np.repeat(x, case.Hq // case.Hkv, axis=2) for x in (case.k, case.v))
    repeated = AttentionCase(case.q, k, v, case.softmax_scale, case.mask)
    first, second = exact_attention(case), exact_attention(repeated)
    for name in ("o", "o_lo", "lse", "o_err_bound"):
        assert np.array_equal(getattr(first, name), getattr(second, name))


@given(cases(dtypes=("float16",), kinds=("normal",)), st.integers(1, 20), st.integers(0))
def test_sampled_rows_are_exactly_the_evaluated_rows(case: AttentionCase, n: int, seed: int):
    rows = sample_rows(case, n, seed)
    assert rows.shape == (case.B, case.Hq, case.Sq) and rows.dtype == np.bool_
    assert rows.sum() == min(n, rows.size) and rows.flat[0] and (n == 1 or rows.flat[-1])
    assert np.array_equal(rows, sample_rows(case, n, seed))
    partial, full = exact_attention(case, rows), exact_attention(case)
    assert np.array_equal(partial.rows, rows)
    assert np.isnan(partial.lse[~rows]).all() and np.isnan(partial.o_err_bound[~rows]).all()
    assert np.isnan(partial.o.transpose(0, 2, 1, 3)[~rows]).all()
    assert np.array_equal(partial.lse[rows], full.lse[rows])
    assert np.array_equal(partial.o.transpose(0, 2, 1, 3)[rows], full.o.transpose(0, 2, 1, 3)[rows])


@given(cases(dtypes=("float16", "bfloat16"), kinds=("normal",), max_len=16))
def test_float64_softmax_agrees_on_benign_inputs(case: AttentionCase) -> None:
    seen = visible_all(case)  # [B, Hq, Sq, Sk]
    heads = np.arange(case.Hq) // (case.Hq // case.Hkv)
    q = np.nan_to_num(case.q.astype(np.float64)).transpose(0, 2, 1, 3)
    k = np.nan_to_num(case.k.astype(np.float64))[:, :, heads].transpose(0, 2, 3, 1)
    v = np.nan_to_num(case.v.astype(np.float64))[:, :, heads].transpose(0, 2, 1, 3)
    s = np.where(seen, q @ k * case.softmax_scale, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = p.sum(-1, keepdims=True)
    o = np.where(total > 0, (p @ v) / np.where(total > 0, total, 1.0), 0.0).transpose(0, 2, 1, 3)
    exact = exact_attention(case)
    vmax = max(np.abs(v).max(), 1.0)
    assert np.abs(exact.o - o).max() <= 1e-12 * vmax
    with np.errstate(divide="ignore"):  # empty rows: log(0) = -inf, the convention
        lse = (m + np.log(total))[..., 0]
    finite = np.isfinite(exact.lse)
    assert np.array_equal(finite, np.isfinite(lse))
    gap = np.abs(exact.lse[finite] - lse[finite])
    assert gap.max(initial=0.0) <= 1e-12 * (1 + np.abs(lse[finite]).max(initial=0.0))


def test_bfloat16_extreme_exponents_against_naive_loop() -> None:
    """Scores near 2^±250 and values spanning bf16's whole range stay exact."""
    rng = np.random.default_rng(3)
    shape = (1, 3, 1, 4)
    q = (rng.choice([-1.0, 1.0], shape) * np.exp2(rng.integers(-133, 127, shape))).astype(
        ml_dtypes.bfloat16
    )
    k = rng.choice([-1.0, 1.0], (1, 5, 1, 4)) * np.exp2(rng.integers(-133, 127, (1, 5, 1, 4)))
    v = np.exp2(rng.integers(-133, 127, (1, 5, 1, 2))) * rng.choice([-1.0, 1.0], (1, 5, 1, 2))
    case = AttentionCase(q, k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16), 2.0**-40)
    exact, naive = exact_attention(case), naive_exact_attention(case)
    o_bound = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    assert agrees_with_double(exact.o, exact.o_lo, o_bound, naive.o).all()
    lse_allowed = exact.lse_err_bound + np.spacing(np.abs(naive.lse))
    assert np.all(np.abs(exact.lse - naive.lse) <= lse_allowed)


@pytest.mark.parametrize("prec_bits", [64, 128, 200])
def test_exp_fixed_meets_the_assumed_error_bound(prec_bits: int) -> None:
    """The certificate assumes |exp_fixed(x, F) - exp(x 2^-F) 2^F| <= EXP_FIXED_ERROR_BOUND for
    x <= 0 down to the skip cutoff; sample it against mpmath at twice the precision."""
    rng = np.random.default_rng(prec_bits)
    ln2 = ln2_fixed(prec_bits)
    worst = 0.0
    for fraction in rng.random(400):
        x = -int(Fraction(float(fraction)) * (prec_bits + 2) * ln2)
        reference = mpf_exp(from_man_exp(x, -prec_bits), 2 * prec_bits + 20)
        got = from_man_exp(exp_fixed(x, prec_bits, ln2), -prec_bits)
        worst = max(worst, abs(to_float(mpf_sub(got, reference, 2 * prec_bits + 20))))
    assert math.ldexp(worst, prec_bits) <= EXP_FIXED_ERROR_BOUND


def test_argument_validation() -> None:
    case = AttentionCase(*(np.zeros((1, 2, 1, 2), np.float16) for _ in range(3)))
    with pytest.raises(ValueError, match="prec_bits"):
        exact_attention(case, prec_bits=32)
    with pytest.raises(ValueError, match="rows"):
        exact_attention(case, np.ones((1, 2), dtype=bool))
    with pytest.raises(ValueError, match="n="):
        sample_rows(case, 0)


def test_sample_rows_of_a_case_without_query_rows_is_empty() -> None:
    q = np.zeros((2, 0, 3, 4), np.float16)
    kv = np.zeros((2, 5, 3, 4), np.float16)
    case = AttentionCase(q, kv, kv)
    rows = sample_rows(case, 3)
    assert rows.shape == (2, 3, 0) and rows.dtype == np.bool_
    assert exact_attention(case, rows).o.shape == (2, 0, 3, 4)
