"""Properties of the exact backward tier (reference/exact_backward.py): agreement with an
independent mpmath loop, the certified radius, directional derivatives of the exact forward,
sampling, conventions (empty rows, padding, GQA), the fixed-point exponential, validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpmath.libmp import from_man_exp, mpf_exp, mpf_sub, to_float

from attention_crossval.properties.exact_oracles import (
    agrees_with_double,
    cases,
    dtype_values,
    naive_backward,
)
from attention_crossval.properties.strategies import backward_cases
from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, Mask
from attention_crossval.reference.exact import (
    _bit_width,
    _plan_limbs,
    _to_limbs,
    dyadic_matmul,
    exact_attention,
    sample_rows,
)
from attention_crossval.reference.exact_backward import (
    _FixedExp,
    _limbs_to_ints,
    _row_max,
    _scores,
    _word_ints,
    _words,
    exact_backward,
    sample_keys,
)
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.masks import empty_rows, visible

pytestmark = pytest.mark.cpu

GRADS = ("dq", "dk", "dv")


@st.composite
def wide_backward_cases(draw, max_len: int = 6) -> BackwardCase:
    """test_exact's forward cases (log-uniform magnitudes over whole exponent ranges, every
    mask kind, NaN padding) plus dO of the same kind, and dlse half the time."""
    case = draw(cases(max_len=max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "wide"]))
    do = dtype_values(rng, (case.B, case.Sq, case.Hq, case.Dv), case.dtype, kind)
    for b, n in enumerate(case.mask.q_lengths or ()):
        do[b, n:] = np.nan  # padding must never be read
    dlse = rng.standard_normal((case.B, case.Hq, case.Sq)) if draw(st.booleans()) else None
    return BackwardCase(case, do, dlse)


_ALL_CASES = st.one_of(backward_cases(max_len=8, max_heads=2), wide_backward_cases())


@given(_ALL_CASES)
def test_exact_backward_matches_naive_loop(case: BackwardCase) -> None:
    exact, naive = exact_backward(case), naive_backward(case)
    for name in GRADS:
        hi, lo, bound = (getattr(exact, name + suffix) for suffix in ("", "_lo", "_err_bound"))
        assert agrees_with_double(hi, lo, bound, naive[name]).all(), name
    rows = np.isfinite(exact.d)  # rows whose statistics were computed
    assert agrees_with_double(exact.d, 0 * exact.d, exact.d_err_bound, naive["d"])[rows].all()
    forward = exact_attention(case.forward)  # the LSE the row statistics imply, certified twice
    finite = rows & np.isfinite(forward.lse)
    assert np.array_equal(exact.lse[rows & ~finite], forward.lse[rows & ~finite])
    gap = np.abs(exact.lse[finite] - forward.lse[finite])
    assert np.all(gap <= (exact.lse_err_bound + forward.lse_err_bound)[finite])


@given(st.one_of(backward_cases(max_len=6, max_heads=2), wide_backward_cases(max_len=5)))
def test_certified_radius_holds_and_is_tiny(case: BackwardCase) -> None:
    """128 bits against 512: the difference fits in the sum of both radii, and the 128-bit
    radius beyond the double-double term is below 2^-90 of the gradient's natural scale.
    Where that scale is 0 (dO = 0, no dlse) every gradient is exactly 0 and the radius is the
    fixed-point grid's rounding quantum alone: asserted below 2^-100 (2^-154 and 2^-147.6 seen,
    the latter under the commit seed of bc03881)."""
    coarse, fine = exact_backward(case), exact_backward(case, prec_bits=512)
    for name in GRADS:
        a, b = (
            (getattr(r, name), getattr(r, name + "_lo"), getattr(r, name + "_err_bound"))
            for r in (coarse, fine)
        )
        gap = np.abs((a[0] - b[0]) + (a[1] - b[1]))
        assert np.all(gap <= (a[2] + b[2]) * (1 + 2.0**-40)), name
        excess = a[2] - np.abs(a[0]) * 2.0**-103 - 2.0**-1070
        scale = _natural_scale(case, name)
        if scale == 0:
            assert not np.any(a[0]) and np.all(excess <= 2.0**-100), name
        else:
            assert np.all(excess <= 2.0**-90 * max(scale, FLOOR_SCALE)), name


# A small gradient scale still admits the grid's quantum (2^-150 and above).
FLOOR_SCALE = 2.0**-60


def _natural_scale(case: BackwardCase, name: str) -> float:
    """``max |dO| max |V| max |q or k| n scale`` (or ``max |dO| n`` for dv): no gradient
    element's terms are larger; 0 where every gradient is exactly 0."""
    f = case.forward
    valid = [np.abs(x[np.isfinite(x)].astype(float)).max(initial=0) for x in (f.q, f.k, f.v)]
    do = float(np.abs(case.do[np.isfinite(case.do)].astype(float)).max(initial=0))
    n = max(f.Sq * f.Hq, f.Sk)
    if name == "dv":
        return do * n
    dlse = 0.0 if case.dlse is None else float(np.abs(case.dlse[np.isfinite(case.dlse)]).max())
    return f.softmax_scale * n * (2 * do * valid[2] + dlse) * max(valid[:2])


@given(st.integers(0, 2**32 - 1), st.sampled_from(["q", "k", "v"]), st.booleans())
def test_directional_derivative_matches_the_exact_forward(seed: int, what: str, causal: bool):
    """``<dO, O(x + e d) - O(x - e d)> / 2e = <dx, d>`` with O from the forward exact tier (200
    bits): to O(e^2) for q and k, exactly for v (O is linear in V). Inputs on a 2^-8 grid in
    [-4, 4] stay exact in fp32 after adding e d = +-2^-20."""
    rng = np.random.default_rng(seed)
    B, Sq, Sk, Hkv, group, D, Dv = 1, 4, 5, 1, 2, 3, 2

    def grid(shape):
        return (np.round(rng.uniform(-4, 4, shape) * 256) / 256).astype(np.float32)

    forward = AttentionCase(
        grid((B, Sq, Hkv * group, D)), grid((B, Sk, Hkv, D)), grid((B, Sk, Hkv, Dv)),
        mask=Mask(causal=causal),
    )  # fmt: skip
    case = BackwardCase(forward, grid((B, Sq, Hkv * group, Dv)))
    grads = exact_backward(case)
    x = getattr(forward, what)
    direction = rng.choice([-1.0, 0.0, 1.0], x.shape)
    eps = 2.0**-20

    def output(sign: float) -> tuple[np.ndarray, np.ndarray]:
        moved = (x + sign * eps * direction).astype(np.float32)
        assert np.array_equal(moved.astype(np.float64), x + sign * eps * direction)
        result = exact_attention(dataclasses.replace(forward, **{what: moved}), prec_bits=200)
        return result.o, result.o_lo

    (hi_plus, lo_plus), (hi_minus, lo_minus) = output(1), output(-1)
    change = (hi_plus - hi_minus) + (lo_plus - lo_minus)  # hi - hi is exact (Sterbenz)
    difference = float(np.sum(case.do.astype(np.float64) * change)) / (2 * eps)
    predicted = float(np.sum(getattr(grads, "d" + what) * direction))
    tolerance = (1e-9 if what != "v" else 1e-13) * max(1.0, abs(predicted))
    assert abs(difference - predicted) <= tolerance


@given(backward_cases(max_len=10, max_heads=4), st.integers(1, 12), st.integers(0))
def test_sampled_rows_and_keys_are_the_evaluated_elements(
    case: BackwardCase, n: int, seed: int
) -> None:
    rows, keys = sample_rows(case.forward, n, seed), sample_keys(case, n, seed)
    result = exact_backward(case, rows=rows, keys=keys)
    assert np.array_equal(np.isfinite(result.dq).all(axis=-1), rows.transpose(0, 2, 1))
    assert np.array_equal(np.isfinite(result.dk).all(axis=-1), keys.transpose(0, 2, 1))
    assert np.array_equal(np.isfinite(result.dv).all(axis=-1), keys.transpose(0, 2, 1))
    full = exact_backward(case)
    for name in GRADS:  # both are certified: they agree within the sum of their radii
        part = getattr(result, name)
        evaluated = np.isfinite(part)
        hi = part[evaluated] - getattr(full, name)[evaluated]
        lo = getattr(result, name + "_lo")[evaluated] - getattr(full, name + "_lo")[evaluated]
        radii = getattr(result, name + "_err_bound") + getattr(full, name + "_err_bound")
        assert np.all(np.abs(hi + lo) <= radii[evaluated]), name


@given(backward_cases(max_len=10, max_heads=4, mask_kinds=("causal", "window", "varlen")))
def test_empty_rows_and_padding_have_exactly_zero_gradient(case: BackwardCase) -> None:
    f = case.forward
    result = exact_backward(case)
    empty = empty_rows(f).transpose(0, 2, 1)  # [B, Sq, Hq]
    assert np.all(result.dq[empty] == 0) and np.all(result.dq_err_bound[empty] == 0)
    assert np.all(result.d.transpose(0, 2, 1)[empty] == 0)
    seen_by_someone = np.zeros((f.B, f.Sk, f.Hkv), dtype=bool)
    for b in range(f.B):
        for h in range(f.Hq):
            seen_by_someone[b, :, f.kv_head(h)] |= visible(f, b, h).any(axis=0)
    for name in ("dk", "dv"):
        unseen = ~seen_by_someone  # padded keys (past k_lengths) among them
        assert np.all(getattr(result, name)[unseen] == 0), name
        assert np.all(getattr(result, name + "_err_bound")[unseen] == 0), name


@given(wide_backward_cases(max_len=5))
def test_gqa_equals_the_mha_expansion_summed_per_group(case: BackwardCase) -> None:
    f = case.forward
    group = f.Hq // f.Hkv
    mha = BackwardCase(
        dataclasses.replace(f, k=np.repeat(f.k, group, axis=2), v=np.repeat(f.v, group, axis=2)),
        case.do,
        case.dlse,
    )
    gqa, expanded = exact_backward(case), exact_backward(mha)
    # Both dq are certified; their fixed-point grids may differ (the shift and format follow
    # the kv head's magnitudes), so they agree within the sum of their radii, not bitwise.
    dq_gap = (gqa.dq - expanded.dq) + (gqa.dq_lo - expanded.dq_lo)
    assert np.all(np.abs(dq_gap) <= gqa.dq_err_bound + expanded.dq_err_bound)
    for name in ("dk", "dv"):
        terms = getattr(expanded, name) + getattr(expanded, name + "_lo")
        terms = terms.reshape(*terms.shape[:2], f.Hkv, group, -1)
        summed, magnitude = terms.sum(axis=3), np.abs(terms).sum(axis=3)
        radius = getattr(expanded, name + "_err_bound")
        radius = radius.reshape(*radius.shape[:2], f.Hkv, group, -1).sum(axis=3)
        ours = getattr(gqa, name) + getattr(gqa, name + "_lo")
        allowed = radius + getattr(gqa, name + "_err_bound") + 4 * group * np.spacing(magnitude)
        assert np.all(np.abs(ours - summed) <= allowed), name


@pytest.mark.parametrize(
    ("scale", "score_exponent", "prec_bits"),
    [(0.125, -20, 128), (1 / 11.3, -45, 100), (3.0, 3, 200), (2.0**-40, -300, 128)],
)
def test_fixed_point_exp_is_within_delta(scale: float, score_exponent: int, prec_bits: int):
    """Table-product weights against mpmath at three times the precision, over gaps that hit
    0, every chunk, the cap and beyond: ``|W~ - exp(-c x 2^e_s)| <= delta``."""
    exp = _FixedExp(scale, score_exponent, prec_bits, 1 << 70)
    G, cap = exp.fraction_bits, exp.cap
    rng = np.random.default_rng(prec_bits)
    top = min(cap + 5, 1 << 70)  # gaps up to max_gap, the caller's promise
    gaps = [0, 1] + ([cap - 1, cap, cap + 1] if cap < 1 << 70 else [top])
    gaps += [int(top * f) for f in rng.random(300)]
    gaps += [int(g) for g in np.exp2(rng.uniform(0, math.log2(top), 300))]
    gaps = np.array(gaps, dtype=object)[None, :]
    weights = _limbs_to_ints(exp.weights(_words(gaps, 4), np.ones(gaps.shape, dtype=bool)))[0]
    man, e = scale.as_integer_ratio()[0], 1 - scale.as_integer_ratio()[1].bit_length()
    worst = 0.0
    for x, w in zip(gaps[0], weights, strict=True):
        true = mpf_exp(from_man_exp(-man * int(x), e + score_exponent), 3 * G)
        worst = max(worst, abs(to_float(mpf_sub(true, from_man_exp(int(w), -G), 3 * G))))
    assert worst <= exp.delta
    assert weights[0] == 1 << G  # the row maximum weighs exactly 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_score_words_are_the_exact_scores_and_their_row_maxima(dtype: str) -> None:
    """The int64 words of the scores (signed, over ~250 binades) hold the exact Python-int
    GEMM of the limbs, and their row maxima over a mask are the Python ints' maxima."""
    rng = np.random.default_rng(3)
    q, k = (dtype_values(rng, (n, 5), dtype, "wide").astype(np.float64) for n in (6, 9))
    ints, exponent = dyadic_matmul(q, k)
    wq, nq, wk, nk = _plan_limbs(_bit_width(q), _bit_width(k), q.shape[1])
    q_int, k_int = _to_limbs(q, wq, nq), _to_limbs(k, wk, nk)
    assert q_int.exponent + k_int.exponent == exponent
    words = _scores(q_int, k_int, slice(None))
    assert [_word_ints(words[:, i]) for i in range(6)] == ints.tolist()
    seen = rng.random((6, 9)) < 0.5
    seen[:, 0] = True
    expected = [max(row[mask]) for row, mask in zip(ints, seen, strict=True)]
    assert _word_ints(_row_max(words, seen)) == expected


def test_argument_validation() -> None:
    f = AttentionCase(*(np.zeros((1, 2, 1, 2), np.float16) for _ in range(3)))
    case = BackwardCase(f, np.zeros((1, 2, 1, 2), np.float16))
    for bad in (32, 1001, True, 128.0):
        with pytest.raises(ValueError, match="prec_bits"):
            exact_backward(case, prec_bits=bad)
    with pytest.raises(ValueError, match="rows"):
        exact_backward(case, rows=np.ones((1, 2), dtype=bool))
    with pytest.raises(ValueError, match="keys"):
        exact_backward(case, keys=np.ones((1, 1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="case"):
        exact_backward(f)
    with pytest.raises(ValueError, match="keys to sample"):
        sample_keys(case, 0)


def test_bfloat16_extreme_exponents_against_naive_loop() -> None:
    """Scores spanning ~250 binades span many score words and dozens of exp chunks."""
    rng = np.random.default_rng(7)
    dtype = INPUT_DTYPES["bfloat16"]
    values = [dtype_values(rng, (1, 3, 2, 3), "bfloat16", "wide") for _ in range(2)]
    kv = [dtype_values(rng, (1, 4, 1, 3), "bfloat16", "wide") for _ in range(2)]
    forward = AttentionCase(values[0], kv[0], kv[1], softmax_scale=2.0**-60)
    case = BackwardCase(forward, values[1].astype(dtype))
    exact, naive = exact_backward(case), naive_backward(case, dps=200)
    for name in GRADS:
        hi, lo, bound = (getattr(exact, name + suffix) for suffix in ("", "_lo", "_err_bound"))
        assert agrees_with_double(hi, lo, bound, naive[name]).all(), name
