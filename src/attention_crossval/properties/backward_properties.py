"""The backward pass's CPU properties, each a function of the tier under test, so that the
tests run them on ``reference.streaming_backward`` and the mutation hunt
(:mod:`testing.mutants_backward`) runs the very same checks on broken copies of it.

A *tier* is any namespace with ``streaming_backward`` and ``RowSumTrace`` (the production
module or a mutated copy). Each :class:`BackwardProperty` in :data:`PROPERTIES` pairs a check
``check(tier, *args)`` (raises ``AssertionError`` when the property fails) with the Hypothesis
strategy of its ``args`` tuple.

``dense_backward`` is the textbook gradient (full score matrix, float64) with the magnitude of
the terms each element sums, so float64 agreement is judged relative to the computation's own
scale (dS = P (dP - D) cancels by design for some dO distributions, so |dq| itself may be ~0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

from attention_crossval.properties.strategies import REFERENCE_SPEC, backward_cases
from attention_crossval.reference.bounds_backward import backward_error_bound
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.exact import ExactResult, exact_attention
from attention_crossval.reference.exact_backward import exact_backward
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import empty_rows, visible_all
from attention_crossval.reference.precision import BackwardPrecision

BLOCKS = {"block_m": REFERENCE_SPEC.tile_m, "block_n": REFERENCE_SPEC.tile_n}
FLOAT64 = BackwardPrecision.float64()
# Float64 agreement, relative to the magnitude of the summed terms times exp's condition number
# (1 + the largest |logit|): P = exp(s - lse) carries |s| * 2^-53 of relative error.
FLOAT64_RTOL = 1e-12
GRADS = ("dq", "dk", "dv")
# Directional derivative: central differences at eps and 2 eps, Richardson-extrapolated (error
# O(eps^4)); x +- eps * delta with delta = +-2^floor(log2 |x|) is exact in float32 for bf16 x.
EPS = 2.0**-14
# What scales with the derivative: the float64 backward, the eps^4 truncation, float64's
# rounding of the differences (measured in docs/results-cpu.md, bench_directional_derivative).
DIRECTIONAL_RTOL = 1e-10


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
    """Every element within ``tol * magnitude`` (plus float64's smallest normal); an infinite
    allowance (a vacuous bound) admits any number, never NaN."""
    __tracebackhide__ = True
    for name in GRADS:
        a, e, m = (getattr(g, name) for g in (actual, expected, mags))
        allowed = tol * m + np.finfo(np.float64).tiny
        with np.errstate(invalid="ignore"):  # inf - inf where both overflowed
            excess = np.where((allowed == np.inf) & ~np.isnan(a), -1.0, np.abs(a - e) - allowed)
        if not (excess <= 0).all():  # NaN fails too
            i = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), a.shape)
            raise AssertionError(
                f"{name}{list(map(int, i))}: {a[i]!r} vs {e[i]!r}, |diff| {abs(a[i] - e[i]):.3g} "
                f"> allowed {allowed[i]:.3g} ({tol:.3g} x {m[i]:.3g})"
            )


def gqa_case() -> BackwardCase:
    """Hq=4 over Hkv=2, causal with padding, bf16: several Q and K blocks of the reference
    tiles, a partial last K block, and a batch with no query rows whose padding (q, k, v, dO
    past the lengths) is NaN, so reading it shows."""
    rng = np.random.default_rng(7)
    dt = np.dtype("bfloat16")
    q, k, v = (
        rng.standard_normal(shape) for shape in ((2, 33, 4, 4), (2, 41, 2, 4), (2, 41, 2, 8))
    )
    do = rng.standard_normal((2, 33, 4, 8))
    q[1], do[1], k[1, 17:], v[1, 17:] = np.nan, np.nan, np.nan, np.nan
    mask = Mask(causal=True, q_lengths=(33, 0), k_lengths=(41, 17))
    case = AttentionCase(q.astype(dt), k.astype(dt), v.astype(dt), None, mask)
    return BackwardCase(case, do.astype(dt))


def tiny_do_cancelling_v_case() -> BackwardCase:
    """One bf16 query over 7 keys of small scores, V = +-1000 alternating, dO = -1.7e-8: with
    an LSE gradient, <dq, delta> (~1e-3) comes almost wholly from dlse, and the half-ulp
    rounding of the exact forward's LSE (~2) divided by 2 eps exceeds 1e-10 of its scale."""
    dt = np.dtype("bfloat16")
    q = np.array([0.205078, 0.0825195]).reshape(1, 1, 1, 2)
    k = np.array(
        [
            [-0.326172, 0.226562],
            [0.111816, -0.133789],
            [0.145508, 0.0913086],
            [0.0737305, 0.0071106],
            [0.136719, -0.18457],
            [-0.0407715, -0.120605],
            [0.149414, 0.00994873],
        ]
    ).reshape(1, 7, 1, 2)
    v = 1000.0 * np.array([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]).reshape(1, 7, 1, 1)
    case = AttentionCase(q.astype(dt), k.astype(dt), v.astype(dt), None, Mask())
    return BackwardCase(case, np.full((1, 1, 1, 1), -1.68802e-08).astype(dt))


# --- the properties -------------------------------------------------------------------------


def float64_matches_exact(tier: ModuleType, case: BackwardCase) -> None:
    """float64 mode equals the certified exact gradient (every element) to ~1e-12 of the
    summed terms' magnitude, beyond the exact tier's own radius."""
    exact = exact_backward(case)
    dense = dense_backward(case)
    actual = tier.streaming_backward(case, FLOAT64, **BLOCKS)
    expected = Gradients(*(getattr(exact, n) + getattr(exact, f"{n}_lo") for n in GRADS))
    tol = Gradients(
        *(
            FLOAT64_RTOL * dense.kappa * getattr(dense.mags, n) + getattr(exact, f"{n}_err_bound")
            for n in GRADS
        )
    )
    assert_gradients_close(actual, expected, tol, 1.0)


def emulated_within_bound(
    tier: ModuleType, case: BackwardCase, deterministic: bool, seed: int
) -> None:
    """FlashAttention's chain for the case's dtype (deterministic or atomic dQ order) stays
    within the bound derived from that chain (``reference.bounds_backward``), every element,
    measured against the certified exact gradient (its radius added)."""
    precision = BackwardPrecision.flash_attention(case.forward.dtype, deterministic=deterministic)
    exact = exact_backward(case)
    expected = Gradients(*(getattr(exact, n) + getattr(exact, f"{n}_lo") for n in GRADS))
    actual = tier.streaming_backward(case, precision, **BLOCKS, seed=seed)
    bound = backward_error_bound(case, precision, expected, block_n=BLOCKS["block_n"])
    allowed = Gradients(*(getattr(bound, n) + getattr(exact, f"{n}_err_bound") for n in GRADS))
    assert_gradients_close(actual, expected, allowed, 1.0)


def ds_rows_sum_to_dlse(tier: ModuleType, case: BackwardCase, with_dlse: bool) -> None:
    """``sum_j dS_ij = sum_j P_ij dP_ij - D_i = dlse_i`` (0 without an LSE gradient) on every
    row: the identity the D term exists for."""
    if with_dlse:
        f = case.forward
        dlse = np.random.default_rng(0).standard_normal((f.B, f.Hq, f.Sq))
        case = dataclasses.replace(case, dlse=dlse)
    trace = tier.RowSumTrace()
    tier.streaming_backward(case, FLOAT64, **BLOCKS, trace=trace)
    dense = dense_backward(case)
    expected = np.zeros_like(trace.ds_sum) if case.dlse is None else case.dlse
    rows, _ = _valid(case.forward)
    expected = np.where(rows[:, None, :] & ~empty_rows(case.forward), expected, 0.0)
    tol = FLOAT64_RTOL * dense.kappa * dense.ds_row_mag + np.finfo(np.float64).tiny
    bad = ~(np.abs(trace.ds_sum - expected) <= tol)
    assert not bad.any(), (
        f"sum_j dS_ij = {trace.ds_sum[bad][0]!r}, expected {expected[bad][0]!r} at row "
        f"{np.argwhere(bad)[0].tolist()}"
    )


def p_rows_sum_to_one(tier: ModuleType, case: BackwardCase) -> None:
    """P = exp2(S c - LSE2) from the forward's LSE sums to 1 on every non-empty valid row and
    to 0 on empty rows: a stale or misaligned LSE breaks it row by row."""
    trace = tier.RowSumTrace()
    tier.streaming_backward(case, FLOAT64, **BLOCKS, trace=trace)
    kappa = dense_backward(case).kappa
    rows, _ = _valid(case.forward)
    expected = (rows[:, None, :] & ~empty_rows(case.forward)).astype(np.float64)
    bad = ~(np.abs(trace.p_sum - expected) <= FLOAT64_RTOL * kappa * max(case.forward.Sk, 1))
    assert not bad.any(), f"sum_j P_ij = {trace.p_sum[bad][0]!r} at row {np.argwhere(bad)[0]}"


def zero_gradient_where_unseen(tier: ModuleType, case: BackwardCase, chain: str) -> None:
    """dq of an empty or padded query row, and dk/dv of a key no valid row of its group sees
    (padded keys included), are exactly 0, in float64 and in ``chain``'s emulation."""
    f = case.forward
    precision = dataclasses.replace(BackwardPrecision.flash_attention(chain), output_dtype=None)
    unseen = ~visible_all(f).any(axis=2)  # [B, Hq, Sk]: keys no row of the head sees
    unseen = unseen.reshape(f.B, f.Hkv, f.group_size, f.Sk).all(axis=2).transpose(0, 2, 1)
    for grads in (tier.streaming_backward(case, p, **BLOCKS) for p in (FLOAT64, precision)):
        assert (grads.dq.transpose(0, 2, 1, 3)[empty_rows(f)] == 0).all(), "dq of an empty row"
        assert (grads.dk[unseen] == 0).all(), "dk of a key no row sees"
        assert (grads.dv[unseen] == 0).all(), "dv of a key no row sees"


def deterministic_across_seeds(tier: ModuleType, case: BackwardCase, seed: int) -> None:
    """dq_order='fixed' ignores the seed: seeds 0 and ``seed`` give bitwise equal dq, dk, dv.
    The output rounding is off so that it cannot hide a changed accumulation order."""
    precision = dataclasses.replace(
        BackwardPrecision.flash_attention(case.forward.dtype), output_dtype=None
    )
    first = tier.streaming_backward(case, precision, **BLOCKS, seed=0)
    again = tier.streaming_backward(case, precision, **BLOCKS, seed=seed)
    for name in GRADS:
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name), err_msg=name)


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


def key_permutation_permutes_dk_dv(tier: ModuleType, case: BackwardCase, seed: int) -> None:
    """Attention is a function of the key *set*: permuting the valid keys (with their
    explicit-mask columns) permutes dk and dv and leaves dq alone (float64, up to
    summation-order rounding). Needs masks without causal/window (position-dependent)."""
    permuted, perms = _permute_keys(case, seed)
    base = tier.streaming_backward(case, FLOAT64, **BLOCKS)
    moved = tier.streaming_backward(permuted, FLOAT64, **BLOCKS)
    dk, dv = moved.dk.copy(), moved.dv.copy()
    for b, perm in enumerate(perms):  # undo the permutation: old[perm[j]] = new[j]
        dk[b, perm], dv[b, perm] = moved.dk[b, : len(perm)], moved.dv[b, : len(perm)]
    dense = dense_backward(case)
    assert_gradients_close(
        Gradients(moved.dq, dk, dv), base, dense.mags, FLOAT64_RTOL * dense.kappa
    )


def gqa_equals_mha_expansion(tier: ModuleType, case: BackwardCase) -> None:
    """With k, v repeated for every query head (MHA), dq is unchanged and the GQA dk/dv are
    the MHA ones summed over each group's query heads."""
    f = case.forward
    k, v = (np.repeat(x, f.group_size, axis=2) for x in (f.k, f.v))
    mha = BackwardCase(dataclasses.replace(f, k=k, v=v), case.do, case.dlse)
    expanded = tier.streaming_backward(mha, FLOAT64, **BLOCKS)
    groups = (f.B, f.Sk, f.Hkv, f.group_size)
    summed = Gradients(
        expanded.dq,
        expanded.dk.reshape(groups + (f.D,)).sum(axis=3),
        expanded.dv.reshape(groups + (f.Dv,)).sum(axis=3),
    )
    gqa = tier.streaming_backward(case, FLOAT64, **BLOCKS)
    dense = dense_backward(case)
    assert_gradients_close(gqa, summed, dense.mags, FLOAT64_RTOL * dense.kappa)


def _direction(x: np.ndarray, valid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``+-2^floor(log2 |x|)`` per element (``+-2^-8`` where x = 0), 0 on padding."""
    x = x.astype(np.float64)
    with np.errstate(divide="ignore"):
        power = np.where(x != 0, 2.0 ** np.floor(np.log2(np.abs(x))), 2.0**-8)
    sign = rng.choice([-1.0, 1.0], size=x.shape)
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), sign * power, 0.0)


def _exact_forward_at(case: BackwardCase, wrt: str, shift: np.ndarray) -> ExactResult:
    """The exact forward (128 bits) of ``case`` with ``wrt`` moved by ``shift``, which must
    leave it exact in float32."""
    f = case.forward
    moved = getattr(f, wrt).astype(np.float64) + shift
    x32 = moved.astype(np.float32)
    assert (x32.astype(np.float64) == moved).all(), "perturbed input is not exact in float32"
    return exact_attention(dataclasses.replace(f, **{wrt: x32}), prec_bits=128)


def _central_difference(
    case: BackwardCase, wrt: str, delta: np.ndarray, eps: float
) -> tuple[float, float]:
    """``(F(x + eps delta) - F(x - eps delta)) / 2 eps`` of ``F = <dO, O> + <dlse, LSE>`` from
    the exact forward, and the radius its certified error gives the quotient:
    ``(sum |dO| (o_err+ + o_err-) + sum |dlse| (lse_err+ + lse_err-)) / 2 eps``.

    Each output is differenced before dO or dlse multiplies it (O as the double-double
    ``o + o_lo``), so float64 rounds the small difference, never the products ``dO O`` or
    ``dlse LSE`` whose rounding (relative 2^-53 of |O| ~ |V| or of |LSE|) the division by
    2 eps would amplify 2^13-fold. Empty rows (LSE = -inf, dlse 0) add nothing."""
    plus, minus = (_exact_forward_at(case, wrt, sign * eps * delta) for sign in (1.0, -1.0))
    do = np.nan_to_num(case.do.astype(np.float64))
    change = float(np.sum(do * ((plus.o - minus.o) + (plus.o_lo - minus.o_lo))))
    do_rows = np.abs(do).sum(axis=-1).transpose(0, 2, 1)  # [B, Hq, Sq], as the row bounds
    error = float(np.sum(do_rows * (plus.o_err_bound + minus.o_err_bound)))
    if case.dlse is not None:
        seen = plus.lse > -np.inf  # the same rows at both points: masks ignore values
        dlse = np.where(seen, case.dlse, 0.0)
        lse_plus, lse_minus = (np.where(seen, r.lse, 0.0) for r in (plus, minus))
        change += float(np.sum(dlse * (lse_plus - lse_minus)))
        error += float(np.sum(np.abs(dlse) * (plus.lse_err_bound + minus.lse_err_bound)))
    return change / (2 * eps), error / (2 * eps)


class DirectionalResidual(NamedTuple):
    """``<dx, delta>`` from the tier (``expected``) and the exact forward's extrapolated
    central difference (``estimate``); ``scale = sum |terms of dx| |delta|``; ``radius``: the
    forward's certified error carried through the quotient (see :func:`directional_derivative`)."""

    expected: float
    estimate: float
    scale: float
    radius: float

    @property
    def allowed(self) -> float:
        return DIRECTIONAL_RTOL * self.scale + self.radius + 1e-300


def directional_residual(
    tier: ModuleType, case: BackwardCase, wrt: str, with_dlse: bool, seed: int
) -> DirectionalResidual:
    """The two sides of :func:`directional_derivative` (its arguments) and their allowance."""
    f, rng = case.forward, np.random.default_rng(seed)
    f32 = AttentionCase(
        *(getattr(f, n).astype(np.float32) for n in "qkv"), f.softmax_scale, f.mask, f.label
    )
    dlse = None
    if with_dlse:
        dlse = np.where(empty_rows(f), 0.0, rng.standard_normal((f.B, f.Hq, f.Sq)))
    case32 = BackwardCase(f32, case.do.astype(np.float32), dlse, case.label)
    grads = tier.streaming_backward(case32, FLOAT64, **BLOCKS)
    rows, keys = _valid(f)
    delta = _direction(getattr(f32, wrt), rows if wrt == "q" else keys, rng)
    (d1, r1), (d2, r2) = (_central_difference(case32, wrt, delta, e) for e in (EPS, 2 * EPS))
    magnitude = getattr(dense_backward(case32).mags, f"d{wrt}")  # |terms| dx sums
    return DirectionalResidual(
        expected=float(np.sum(getattr(grads, f"d{wrt}") * delta)),
        estimate=(4 * d1 - d2) / 3,  # Richardson: the eps^2 term cancels
        scale=float(np.sum(magnitude * np.abs(delta))),
        radius=(4 * r1 + r2) / 3,
    )


def directional_derivative(
    tier: ModuleType, case: BackwardCase, wrt: str, with_dlse: bool, seed: int
) -> None:
    """``<dx, delta>`` from the float64 streaming backward equals the Richardson-extrapolated
    central difference of the exact forward (128 bits) along delta: the backward is the
    derivative of the forward the project certifies. The case is carried in float32 so that
    x +- eps delta is exact; its scores must stay moderate so that eps^4 terms are small.

    The allowance has two parts. ``DIRECTIONAL_RTOL`` of ``sum |terms of dx| |delta|`` (dx
    itself may cancel to ~0) covers what scales with the derivative: the float64 backward,
    the O(eps^4) truncation, float64's rounding of the differences. The forward's certified
    error does not scale with it: ``|LSE~ - LSE| <= lse_err_bound`` (half an ulp of a double,
    2^-53 |LSE|) and ``o_err_bound`` enter the quotient divided by 2 eps, and the Richardson
    combination ``(4 D(eps) - D(2 eps)) / 3`` takes ``(4 r(eps) + r(2 eps)) / 3`` of their
    radii ``r`` (:func:`_central_difference`), about ``1.5 * 2^-53 |dlse| |LSE| / eps``. With a
    tiny dO and small ``q . delta`` (a dq directional derivative ~1e-3 per unit dlse) it
    exceeds ``DIRECTIONAL_RTOL`` of the scale (3x on :func:`tiny_do_cancelling_v_case`), so
    it is added, not assumed away (docs/backward-streaming.md)."""
    r = directional_residual(tier, case, wrt, with_dlse, seed)
    assert abs(r.estimate - r.expected) <= r.allowed, (
        f"d{wrt}: <d{wrt}, delta> = {r.expected!r}, central difference {r.estimate!r} "
        f"(|diff| {abs(r.estimate - r.expected):.3g}, scale {r.scale:.3g}, forward radius "
        f"{r.radius:.3g})"
    )


@dataclasses.dataclass(frozen=True)
class BackwardProperty:
    """A named property: ``check(tier, *args)`` on ``args`` drawn from ``strategy``."""

    name: str
    check: Callable[..., None]
    strategy: st.SearchStrategy[tuple]


_SEEDS = st.integers(1, 2**32 - 1)
PROPERTIES: dict[str, BackwardProperty] = {
    p.name: p
    for p in (
        BackwardProperty(
            "float64_matches_exact", float64_matches_exact, st.tuples(backward_cases())
        ),
        BackwardProperty(
            "emulated_within_bound",
            emulated_within_bound,
            st.tuples(backward_cases(), st.booleans(), _SEEDS),
        ),
        BackwardProperty(
            "ds_rows_sum_to_dlse", ds_rows_sum_to_dlse, st.tuples(backward_cases(), st.booleans())
        ),
        BackwardProperty("p_rows_sum_to_one", p_rows_sum_to_one, st.tuples(backward_cases())),
        BackwardProperty(
            "zero_gradient_where_unseen",
            zero_gradient_where_unseen,
            st.tuples(backward_cases(), st.sampled_from(["float16", "bfloat16", "float32"])),
        ),
        BackwardProperty(
            "deterministic_across_seeds",
            deterministic_across_seeds,
            st.tuples(backward_cases(dtypes=["bfloat16", "float16"]), _SEEDS),
        ),
        BackwardProperty(
            "key_permutation_permutes_dk_dv",
            key_permutation_permutes_dk_dv,
            st.tuples(backward_cases(mask_kinds=["varlen", "explicit"]), _SEEDS),
        ),
        BackwardProperty(
            "gqa_equals_mha_expansion",
            gqa_equals_mha_expansion,
            st.tuples(backward_cases().filter(lambda c: c.forward.group_size > 1)),
        ),
        BackwardProperty(
            "directional_derivative",
            directional_derivative,
            st.tuples(
                backward_cases(
                    dtypes=["bfloat16"],
                    distributions=["gaussian", "constant", "tiny_variance", "cancelling_v"],
                    max_len=17,
                    max_heads=2,
                ),
                st.sampled_from(["q", "k", "v"]),
                st.booleans(),
                _SEEDS,
            ),
        ),
    )
}
