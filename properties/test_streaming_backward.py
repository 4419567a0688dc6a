"""reference/streaming_backward.py: the streaming backward against a dense float64 gradient,
the softmax identities on its trace, zero gradient where nothing is seen, and determinism.

``dense_backward`` is the textbook gradient (full score matrix, float64) with the magnitude of
the terms each element sums, so agreement can be judged relative to the computation's own
scale (dS = P (dP - D) cancels by design for some dO distributions).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import REFERENCE_SPEC, backward_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import empty_rows, visible_all
from attention_crossval.reference.precision import BackwardPrecision, StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.reference.streaming_backward import RowSumTrace, streaming_backward

pytestmark = pytest.mark.cpu

BLOCKS = {"block_m": REFERENCE_SPEC.tile_m, "block_n": REFERENCE_SPEC.tile_n}
FLOAT64 = BackwardPrecision.float64()
# Float64 agreement, relative to the magnitude of the summed terms times exp's condition number
# (1 + the largest |logit|): P = exp(s - lse) carries |s| * 2^-53 of relative error.
FLOAT64_RTOL = 1e-12


def _valid(case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    """Bool ``[B, Sq]`` valid query rows and ``[B, Sk]`` valid keys."""
    rows = np.arange(case.Sq)[None] < np.array([case.q_length(b) for b in range(case.B)])[:, None]
    keys = np.arange(case.Sk)[None] < np.array([case.k_length(b) for b in range(case.B)])[:, None]
    return rows, keys


class Dense(NamedTuple):
    """Textbook float64 gradients; ``mags``: the magnitude of the terms each element sums
    (same layout; every product taken in absolute value, dP's and D's dot products included);
    ``ds_row_mag [B, Hq, Sq]``: the same for ``sum_j dS_ij``; ``kappa = 1 + max |logit|``,
    exp's condition number."""

    grads: Gradients
    mags: Gradients
    ds_row_mag: np.ndarray
    kappa: float


def dense_backward(case: BackwardCase) -> Dense:
    """The textbook gradient of ``case`` from the full score matrix; padding is zeroed."""
    f = case.forward
    rows, keys = _valid(f)
    q = np.where(rows[:, :, None, None], f.q.astype(np.float64), 0.0)
    k = np.where(keys[:, :, None, None], f.k.astype(np.float64), 0.0)
    v = np.where(keys[:, :, None, None], f.v.astype(np.float64), 0.0)
    do = np.where(rows[:, :, None, None], case.do.astype(np.float64), 0.0)
    k, v = (np.repeat(x, f.group_size, axis=2) for x in (k, v))
    seen = visible_all(f)
    s = np.where(seen, np.einsum("bihd,bjhd->bhij", q, k) * f.softmax_scale, -np.inf)
    m = np.where(seen.any(-1), s.max(-1), 0.0)[..., None]
    p = np.exp(s - m)
    p = p / np.where(p.sum(-1) > 0, p.sum(-1), 1.0)[..., None]
    o = np.einsum("bhij,bjhd->bihd", p, v)
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    dlse = np.zeros(p.shape[:3]) if case.dlse is None else np.where(rows[:, None], case.dlse, 0)
    d = np.einsum("bihd,bihd->bhi", do, o)[..., None] - dlse[..., None]  # D = dO . O - dlse
    dp_mag = np.einsum("bihd,bjhd->bhij", np.abs(do), np.abs(v))
    d_mag = (p * dp_mag).sum(-1, keepdims=True) + np.abs(dlse)[..., None]
    ds, ds_mag = p * (dp - d), p * (dp_mag + d_mag)
    scale, groups = f.softmax_scale, (f.B, f.Sk, f.Hkv, f.group_size)

    def per_kv_head(x: np.ndarray) -> np.ndarray:
        return x.reshape(groups + x.shape[3:]).sum(axis=3)

    grads = Gradients(
        dq=scale * np.einsum("bhij,bjhd->bihd", ds, k),
        dk=per_kv_head(scale * np.einsum("bhij,bihd->bjhd", ds, q)),
        dv=per_kv_head(np.einsum("bhij,bihd->bjhd", p, do)),
    )
    mags = Gradients(
        dq=scale * np.einsum("bhij,bjhd->bihd", ds_mag, np.abs(k)),
        dk=per_kv_head(scale * np.einsum("bhij,bihd->bjhd", ds_mag, np.abs(q))),
        dv=per_kv_head(np.einsum("bhij,bihd->bjhd", p, np.abs(do))),
    )
    kappa = 1.0 + float(np.abs(np.where(seen, s, 0.0)).max(initial=0.0))
    return Dense(grads, mags, ds_mag.sum(-1), kappa)


def assert_gradients_close(
    actual: Gradients, expected: Gradients, mags: Gradients, tol: float
) -> None:
    """Every element within ``tol * magnitude`` (plus float64's smallest normal)."""
    __tracebackhide__ = True
    for name in ("dq", "dk", "dv"):
        a, e, m = (getattr(g, name) for g in (actual, expected, mags))
        excess = np.abs(a - e) - (tol * m + np.finfo(np.float64).tiny)
        if not (excess <= 0).all():  # NaN fails too
            i = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), a.shape)
            raise AssertionError(
                f"{name}{list(map(int, i))}: {a[i]!r} vs {e[i]!r}, |diff| {abs(a[i] - e[i]):.3g} "
                f"> {tol:.3g} x magnitude {m[i]:.3g}"
            )


def _gqa_case() -> BackwardCase:
    """Hq=4 over Hkv=2, causal with padding, bf16: several Q and K blocks of the reference
    tiles, an empty row (q_lengths 0) and a partial last K block."""
    rng = np.random.default_rng(7)
    dt = np.dtype("bfloat16")
    q, k, v = (
        rng.standard_normal(shape).astype(dt)
        for shape in ((2, 33, 4, 4), (2, 41, 2, 4), (2, 41, 2, 8))
    )
    mask = Mask(causal=True, q_lengths=(33, 0), k_lengths=(41, 17))
    case = AttentionCase(q, k, v, None, mask)
    return BackwardCase(case, rng.standard_normal((2, 33, 4, 8)).astype(dt))


@given(backward_cases())
def test_float64_streaming_matches_the_dense_gradient(case: BackwardCase) -> None:
    """float64 mode equals the textbook gradient to ~1e-12 of the summed terms' magnitude."""
    with reproducer_on_failure(case.forward):
        dense = dense_backward(case)
        actual = streaming_backward(case, FLOAT64, **BLOCKS)
        assert_gradients_close(actual, dense.grads, dense.mags, FLOAT64_RTOL * dense.kappa)


@given(backward_cases(), st.booleans())
def test_ds_rows_sum_to_zero(case: BackwardCase, with_dlse: bool) -> None:
    """sum_j dS_ij = sum_j P_ij dP_ij - D_i = dlse_i for every row (the D term's identity);
    and every non-empty row's recomputed P sums to 1 (P from the right LSE)."""
    if with_dlse:
        f = case.forward
        dlse = np.random.default_rng(0).standard_normal((f.B, f.Hq, f.Sq))
        case = dataclasses.replace(case, dlse=dlse)
    trace = RowSumTrace()
    streaming_backward(case, FLOAT64, **BLOCKS, trace=trace)
    dense = dense_backward(case)
    expected = np.zeros_like(trace.ds_sum) if case.dlse is None else case.dlse
    rows, _ = _valid(case.forward)
    expected = np.where(rows[:, None, :] & ~empty_rows(case.forward), expected, 0.0)
    tol = FLOAT64_RTOL * dense.kappa * dense.ds_row_mag
    bad = ~(np.abs(trace.ds_sum - expected) <= tol + np.finfo(np.float64).tiny)
    assert not bad.any(), f"sum_j dS_ij = {trace.ds_sum[bad][0]!r}, expected {expected[bad][0]!r}"


@given(backward_cases())
def test_recomputed_p_rows_sum_to_one(case: BackwardCase) -> None:
    """P = exp2(S c - LSE2) from the forward's LSE sums to 1 on every non-empty valid row and
    to 0 on empty rows: a stale or misaligned LSE breaks it row by row."""
    trace = RowSumTrace()
    streaming_backward(case, FLOAT64, **BLOCKS, trace=trace)
    kappa = dense_backward(case).kappa
    rows, _ = _valid(case.forward)
    expected = (rows[:, None, :] & ~empty_rows(case.forward)).astype(np.float64)
    bad = ~(np.abs(trace.p_sum - expected) <= FLOAT64_RTOL * kappa * max(case.forward.Sk, 1))
    assert not bad.any(), f"sum_j P_ij = {trace.p_sum[bad][0]!r} at row {np.argwhere(bad)[0]}"


@given(backward_cases(), st.sampled_from(["float16", "bfloat16", "float32"]))
def test_empty_rows_and_padding_have_zero_gradient(case: BackwardCase, chain: str) -> None:
    """dq of an empty or padded query row, and dk/dv of a key no valid row sees (padded keys
    included), are exactly 0 in every precision mode."""
    f = case.forward
    precision = dataclasses.replace(BackwardPrecision.flash_attention(chain), output_dtype=None)
    for grads in (streaming_backward(case, p, **BLOCKS) for p in (FLOAT64, precision)):
        rows_empty = empty_rows(f)  # padded query rows are empty rows
        assert (grads.dq.transpose(0, 2, 1, 3)[rows_empty] == 0).all()
        unseen = ~visible_all(f).any(axis=2)  # [B, Hq, Sk]: keys no row of the head sees
        unseen = unseen.reshape(f.B, f.Hkv, f.group_size, f.Sk).all(axis=2).transpose(0, 2, 1)
        assert (grads.dk[unseen] == 0).all() and (grads.dv[unseen] == 0).all()


@given(backward_cases(dtypes=["bfloat16", "float16"]), st.integers(1, 2**32 - 1))
@example(_gqa_case(), 1)
def test_deterministic_mode_is_bitwise_repeatable_across_seeds(case: BackwardCase, seed: int):
    """dq_order='fixed' ignores the seed: two seeds give bitwise equal dq, dk, dv. The output
    rounding is switched off so that it cannot hide a changed accumulation order."""
    precision = dataclasses.replace(
        BackwardPrecision.flash_attention(case.forward.dtype), output_dtype=None
    )
    first = streaming_backward(case, precision, **BLOCKS, seed=0)
    again = streaming_backward(case, precision, **BLOCKS, seed=seed)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name), err_msg=name)


def test_permuted_dq_order_changes_bits_and_nothing_else() -> None:
    """The control for the property above: on a case with several K blocks, the atomic-add
    order changes dq's bits (so an order change is visible) but never dk or dv."""
    case = _gqa_case()
    precision = dataclasses.replace(
        BackwardPrecision.flash_attention("bfloat16", deterministic=False), output_dtype=None
    )
    first = streaming_backward(case, precision, **BLOCKS, seed=0)
    other = streaming_backward(case, precision, **BLOCKS, seed=1)
    assert (first.dq != other.dq).any()
    np.testing.assert_array_equal(first.dk, other.dk)
    np.testing.assert_array_equal(first.dv, other.dv)
    np.testing.assert_allclose(first.dq, other.dq, rtol=1e-5, atol=1e-6)


def test_given_forward_is_used_and_checked() -> None:
    """``forward=`` replaces the internal forward run (same O/LSE: same gradients), and a
    forward of the wrong shape or without LSE is a ValueError naming the field."""
    case = _gqa_case()
    forward = streaming_attention(case.forward, StreamingPrecision.float64(), **BLOCKS)
    given_fwd = streaming_backward(case, FLOAT64, **BLOCKS, forward=forward)
    internal = streaming_backward(case, FLOAT64, **BLOCKS)
    np.testing.assert_array_equal(given_fwd.dq, internal.dq)
    with pytest.raises(ValueError, match="forward.lse must be given"):
        streaming_backward(case, FLOAT64, forward=AttentionResult(o=forward.o, lse=None))
    with pytest.raises(ValueError, match=r"forward.o shape .* must be \[B, Sq, Hq, Dv\]"):
        streaming_backward(case, FLOAT64, forward=AttentionResult(o=forward.o[:1], lse=forward.lse))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_m": 0}, "block_m=0 must be an int >= 1"),
        ({"block_n": 2.0}, "block_n=2.0 must be an int >= 1"),
        ({"seed": -1}, "seed=-1 must be an int >= 0"),
        ({"precision": StreamingPrecision()}, "precision must be a BackwardPrecision"),
        ({"trace": object()}, "trace must be a RowSumTrace"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        streaming_backward(_gqa_case(), **kwargs)
    with pytest.raises(ValueError, match="case must be a BackwardCase"):
        streaming_backward(_gqa_case().forward)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": "float64"}, "forward must be a StreamingPrecision"),
        ({"p_dtype": "float32"}, "p_dtype='float32' must be None, 'float16' or 'bfloat16'"),
        ({"ds_dtype": "int8"}, "ds_dtype='int8' must be None"),
        ({"accum_dtype": "float16"}, "accum_dtype='float16' must be 'float32' or 'float64'"),
        ({"dq_order": "atomic"}, r"dq_order='atomic' must be one of \['fixed', 'permuted'\]"),
        ({"output_dtype": "float64"}, "output_dtype='float64' must be None or one of"),
    ],
)
def test_bad_backward_precision_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BackwardPrecision(**kwargs)


def test_backward_precision_factories() -> None:
    fa = BackwardPrecision.flash_attention("bfloat16", deterministic=False)
    assert (fa.p_dtype, fa.ds_dtype, fa.accum_dtype, fa.dq_order, fa.output_dtype) == (
        "bfloat16", "bfloat16", "float32", "permuted", "bfloat16",
    )  # fmt: skip
    assert fa.forward == StreamingPrecision.flash_attention("bfloat16")
    assert BackwardPrecision.flash_attention("float32").p_dtype is None
    assert BackwardPrecision.float64().is_float64 and not fa.is_float64
