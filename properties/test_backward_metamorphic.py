"""Metamorphic properties of the streaming backward: relations between runs on related cases,
each independent of any reference gradient.

* permuting the valid keys (with their explicit-mask columns) permutes dk and dv, dq unchanged;
* GQA equals the MHA expansion (k, v repeated per query head) with dk/dv summed per group;
* the directional derivative of the exact forward tier, ``<dO, dO/dx[delta]> + <dlse,
  dLSE/dx[delta]>``, estimated by central differences at 128 bits, equals ``<dx, delta>`` for
  x = q, k, v: the backward is the derivative of the forward the project certifies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import backward_cases
from attention_crossval.properties.test_streaming_backward import (
    BLOCKS,
    FLOAT64,
    FLOAT64_RTOL,
    _gqa_case,
    assert_gradients_close,
    dense_backward,
)
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import empty_rows
from attention_crossval.reference.streaming_backward import streaming_backward

pytestmark = pytest.mark.cpu

# Central differences at eps and 2 eps, Richardson-extrapolated (error O(eps^4)); every perturbed
# input x +- eps * delta with delta = +-2^floor(log2 |x|) is exact in float32 for bf16 x.
EPS = 2.0**-14
DIRECTIONAL_RTOL = 1e-10  # observed <= 6.4e-13 over 300 examples of the cases below


def _permute_keys(case: BackwardCase, seed: int) -> tuple[BackwardCase, list[np.ndarray]]:
    """The case with each batch's valid keys (k, v and explicit-mask columns) permuted, and the
    per-batch permutations (``new[j] = old[perm[j]]``)."""
    f, rng = case.forward, np.random.default_rng(seed)
    k, v = f.k.copy(), f.v.copy()
    explicit = f.mask.explicit
    if explicit is not None:
        explicit = np.broadcast_to(explicit, (f.B, f.Hq, f.Sq, f.Sk)).copy()
    perms = []
    for b in range(f.B):
        perm = rng.permutation(f.k_length(b))
        perms.append(perm)
        n = len(perm)
        k[b, :n], v[b, :n] = f.k[b, perm], f.v[b, perm]
        if explicit is not None:
            explicit[b, :, :, :n] = explicit[b][:, :, perm]
    mask = dataclasses.replace(f.mask, explicit=explicit)
    forward = AttentionCase(k=k, v=v, q=f.q, softmax_scale=f.softmax_scale, mask=mask)
    return BackwardCase(forward, case.do, case.dlse), perms


@given(backward_cases(mask_kinds=["varlen", "explicit"]), st.integers(0, 2**32 - 1))
def test_permuting_keys_permutes_dk_and_dv(case: BackwardCase, seed: int) -> None:
    """Softmax attention is a function of the key *set*: permuting keys permutes dk and dv
    (float64, up to summation-order rounding) and leaves dq alone."""
    with reproducer_on_failure(case.forward):
        permuted, perms = _permute_keys(case, seed)
        base = streaming_backward(case, FLOAT64, **BLOCKS)
        moved = streaming_backward(permuted, FLOAT64, **BLOCKS)
        dk, dv = moved.dk.copy(), moved.dv.copy()
        for b, perm in enumerate(perms):  # undo the permutation: old[perm[j]] = new[j]
            dk[b, perm], dv[b, perm] = moved.dk[b, : len(perm)], moved.dv[b, : len(perm)]
        dense = dense_backward(case)
        tol = FLOAT64_RTOL * dense.kappa
        assert_gradients_close(Gradients(moved.dq, dk, dv), base, dense.mags, tol)


@given(backward_cases())
@example(_gqa_case())
def test_gqa_equals_the_mha_expansion_summed_per_group(case: BackwardCase) -> None:
    """With k, v repeated for every query head (MHA), dq is unchanged and the GQA dk/dv are
    the MHA ones summed over each group's query heads."""
    f = case.forward
    assume(f.group_size > 1)
    with reproducer_on_failure(f):
        k, v = (np.repeat(x, f.group_size, axis=2) for x in (f.k, f.v))
        mha = BackwardCase(dataclasses.replace(f, k=k, v=v), case.do, case.dlse)
        expanded = streaming_backward(mha, FLOAT64, **BLOCKS)
        groups = (f.B, f.Sk, f.Hkv, f.group_size)
        summed = Gradients(
            expanded.dq,
            expanded.dk.reshape(groups + (f.D,)).sum(axis=3),
            expanded.dv.reshape(groups + (f.Dv,)).sum(axis=3),
        )
        gqa = streaming_backward(case, FLOAT64, **BLOCKS)
        dense = dense_backward(case)
        assert_gradients_close(gqa, summed, dense.mags, FLOAT64_RTOL * dense.kappa)


def _direction(x: np.ndarray, valid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``+-2^floor(log2 |x|)`` per element (``+-2^-8`` where x = 0), 0 on padding."""
    x = x.astype(np.float64)
    with np.errstate(divide="ignore"):
        power = np.where(x != 0, 2.0 ** np.floor(np.log2(np.abs(x))), 2.0**-8)
    sign = rng.choice([-1.0, 1.0], size=x.shape)
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), sign * power, 0.0)


def _objective(case: BackwardCase, wrt: str, shift: np.ndarray) -> list[np.ndarray]:
    """The elementwise terms of ``<dO, O> + <dlse, LSE>`` of the exact forward at
    ``wrt + shift``: ``dO o``, ``dO o_lo`` (O is a double-double) and ``dlse LSE`` (0 on empty
    rows, whose LSE is -inf)."""
    f = case.forward
    moved = getattr(f, wrt).astype(np.float64) + shift
    x32 = moved.astype(np.float32)
    assert (x32.astype(np.float64) == moved).all(), "perturbed input is not exact in float32"
    exact = exact_attention(dataclasses.replace(f, **{wrt: x32}), prec_bits=128)
    do = np.nan_to_num(case.do.astype(np.float64))
    terms = [do * exact.o, do * exact.o_lo]
    if case.dlse is not None:
        terms.append(case.dlse * np.where(exact.lse > -np.inf, exact.lse, 0.0))
    return terms


def _central_difference(case: BackwardCase, wrt: str, delta: np.ndarray, eps: float) -> float:
    """``(f(x + eps delta) - f(x - eps delta)) / 2 eps``, differenced term by term so the
    cancellation costs nothing (the exact O is a double-double)."""
    plus, minus = _objective(case, wrt, eps * delta), _objective(case, wrt, -eps * delta)
    return sum(float(np.sum(p - m)) for p, m in zip(plus, minus, strict=True)) / (2 * eps)


@settings(max_examples=min(settings.default.max_examples, 12))
@given(
    backward_cases(
        dtypes=["bfloat16"],
        distributions=["gaussian", "constant", "tiny_variance", "cancelling_v"],
        max_len=17,
        max_heads=2,
    ),
    st.sampled_from(["q", "k", "v"]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_directional_derivative_matches_the_exact_forward(
    case: BackwardCase, wrt: str, with_dlse: bool, seed: int
) -> None:
    """``<dx, delta>`` from the float64 streaming backward equals the Richardson-extrapolated
    central difference of the exact forward (128 bits) along delta, to 1e-10 of
    ``sum |terms of dx| |delta|`` (dx itself may cancel to ~0). The case is carried in float32
    so that x +- eps delta is exact; the scores stay moderate so that eps^4 terms are small."""
    f, rng = case.forward, np.random.default_rng(seed)
    f32 = AttentionCase(
        *(getattr(f, n).astype(np.float32) for n in "qkv"), f.softmax_scale, f.mask, f.label
    )
    dlse = None
    if with_dlse:
        dlse = np.where(empty_rows(f), 0.0, rng.standard_normal((f.B, f.Hq, f.Sq)))
    case32 = BackwardCase(f32, case.do.astype(np.float32), dlse, case.label)
    with reproducer_on_failure(f):
        grads = streaming_backward(case32, FLOAT64, **BLOCKS)
        rows = np.arange(f.Sq)[None] < np.array([f.q_length(b) for b in range(f.B)])[:, None]
        keys = np.arange(f.Sk)[None] < np.array([f.k_length(b) for b in range(f.B)])[:, None]
        delta = _direction(getattr(f32, wrt), rows if wrt == "q" else keys, rng)
        d1 = _central_difference(case32, wrt, delta, EPS)
        d2 = _central_difference(case32, wrt, delta, 2 * EPS)
        estimate = (4 * d1 - d2) / 3  # Richardson: the eps^2 term cancels
        gradient = getattr(grads, f"d{wrt}")
        expected = float(np.sum(gradient * delta))
        magnitude = getattr(dense_backward(case32).mags, f"d{wrt}")  # |terms| dx sums
        scale = float(np.sum(magnitude * np.abs(delta)))
        assert abs(estimate - expected) <= DIRECTIONAL_RTOL * scale + 1e-300, (
            f"d{wrt}: <d{wrt}, delta> = {expected!r}, central difference {estimate!r} "
            f"(|diff| {abs(estimate - expected):.3g}, scale {scale:.3g})"
        )
