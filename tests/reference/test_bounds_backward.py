"""Properties of the derived backward bound (reference/bounds_backward.py).

The streaming backward emulating a declared chain must stay within ``backward_error_bound`` of
the exact gradients (plus the exact tier's own radius) on every adversarial family; the bound
must not be vacuous on ordinary cases; it must be sharp enough that emulating a different chain
than the declared one fails; and elements nothing reaches get bound 0.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, target
from hypothesis import strategies as st

from attention_crossval.properties.strategies import (
    DISTRIBUTIONS,
    GRADIENT_DISTRIBUTIONS,
    backward_cases,
    build_do,
)
from attention_crossval.reference.bounds_backward import GradientBounds, backward_error_bound
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.exact_backward import ExactGradients, exact_backward
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible_all
from attention_crossval.reference.precision import (
    BackwardPrecision,
    StreamingPrecision,
    round_to,
)
from attention_crossval.reference.streaming_backward import streaming_backward
from attention_crossval.report.configs import Config
from attention_crossval.testing.broken.cpu_backward_faults import SOURCE_EDITS, swamped_dq_case
from attention_crossval.testing.mutants import Mutation, mutated_module

pytestmark = pytest.mark.cpu
MODULE = "attention_crossval.reference.streaming_backward"

GRADS = ("dq", "dk", "dv")
CHAINS = (
    "flash",
    "permuted",
    "float64",
    "p_bf16_only",
    "ds_from_rounded_p",
    "dkv_rounded_per_head",
    "ds_scaled",
    "ds_flushes_subnormals",
    "ds_fp16_stale_max",
)


def chain(dtype: str, name: str) -> BackwardPrecision:
    """A declared chain by name: FlashAttention's (deterministic or atomic dQ adds), float64,
    P alone rounded (to bf16) with fp32 outputs, FlashAttention's with dS formed from the
    rounded P (sdpa's efficient backend), with dk/dv rounded per query head before the GQA
    group sum (sdpa's flash backend), with dS scaled and flushed below the smallest normal
    (sdpa's cuDNN backend), dS alone rounded (to fp16) after FA4's stale-max forward."""
    flash = BackwardPrecision.flash_attention(dtype)
    return {
        "flash": flash,
        "permuted": BackwardPrecision.flash_attention(dtype, deterministic=False),
        "float64": BackwardPrecision.float64(),
        "p_bf16_only": BackwardPrecision(forward=flash.forward, p_dtype="bfloat16"),
        "ds_from_rounded_p": dataclasses.replace(flash, ds_from_rounded_p=True),
        "dkv_rounded_per_head": dataclasses.replace(flash, dkv_rounded_per_head=True),
        "ds_scaled": dataclasses.replace(flash, ds_scaled=True),
        "ds_flushes_subnormals": dataclasses.replace(  # fp32 inputs: dS is not rounded
            flash, ds_scaled=True, ds_flushes_subnormals=flash.ds_dtype is not None
        ),
        "ds_fp16_stale_max": BackwardPrecision(
            forward=StreamingPrecision.flash_attention(dtype, rescale_threshold_log2=8.0),
            ds_dtype="float16",
        ),
    }[name]


def bound_fractions(
    got: Gradients, exact: ExactGradients, bounds: GradientBounds
) -> dict[str, np.ndarray]:
    """``|got - exact| / (bound + exact radius)`` per element (inf where the allowance is 0 and
    the error is not, 0 where both are)."""
    out = {}
    for name in GRADS:
        err = np.abs((getattr(got, name) - getattr(exact, name)) - getattr(exact, name + "_lo"))
        allowed = getattr(bounds, name) + getattr(exact, name + "_err_bound")
        with np.errstate(divide="ignore", invalid="ignore"):
            fraction = np.where(allowed > 0, err / allowed, np.where(err > 0, np.inf, 0))
        # An infinite bound (the result may overflow the output dtype) admits any number, inf
        # too, never NaN (as properties.backward_properties.assert_gradients_close does).
        out[name] = np.where(np.isinf(allowed) & ~np.isnan(err), 0.0, fraction)
    return out


def emulate(case: BackwardCase, precision: BackwardPrecision, block_n: int, seed: int = 0):
    """(streaming emulation, exact gradients, the derived bounds) of one case."""
    got = streaming_backward(case, precision, block_m=16, block_n=block_n, seed=seed)
    exact = exact_backward(case)
    return got, exact, backward_error_bound(case, precision, exact.as_gradients())


@given(
    backward_cases(max_len=40, max_heads=4),
    st.sampled_from(CHAINS),
    st.sampled_from([4, 16, 64]),
    st.integers(0, 3),
)
def test_emulated_chain_stays_within_bound(case, name: str, block_n: int, seed: int) -> None:
    """Every score distribution x dO distribution x mask x shape x dtype x chain x tiling."""
    got, exact, bounds = emulate(case, chain(case.forward.dtype, name), block_n, seed)
    for grad, fraction in bound_fractions(got, exact, bounds).items():
        assert np.all(fraction <= 1), f"{grad} {name} block_n={block_n} {case.label}"
        finite = fraction[np.isfinite(getattr(bounds, grad))]
        target(float(finite.max(initial=0)), label=f"{grad} err / bound")


def gaussian_case(dtype: str, *, causal: bool, seed: int = 0, S: int = 96, D: int = 32):
    """Q, K ~ N(0, 1.5), V, dO ~ N(0, 1), two query heads on one kv head."""
    rng = np.random.default_rng(seed)
    cast = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, do = (
        (rng.standard_normal(shape) * s).astype(cast)
        for shape, s in (
            ((1, S, 2, D), 1.5),
            ((1, S, 1, D), 1.5),
            ((1, S, 1, D), 1.0),
            ((1, S, 2, D), 1.0),
        )
    )
    return BackwardCase(AttentionCase(q, k, v, mask=Mask(causal=causal)), do)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bound_is_not_vacuous_on_ordinary_cases(dtype: str, causal: bool) -> None:
    """Gaussian inputs: no vacuous element without a mask, and the chain uses a visible share
    of the bound. With a causal mask, dq of a few rows that one key dominates (max P > 1/2) may be
    vacuous: there dq = scale sum_j P_j (g_j - D) k_j nearly cancels, while the error of D
    (computed from the 16-bit O) enters as scale dD sum_j P_j k_j, which does not cancel."""
    precision = chain(dtype, "flash")
    case = gaussian_case(dtype, causal=causal)
    got, exact, bounds = emulate(case, precision, 64)
    vacuous = bounds.vacuous()
    if causal:
        assert vacuous["dk"] == vacuous["dv"] == 0 and vacuous["dq"] <= 0.02 * bounds.dq.size
        is_vacuous = ((bounds.dq >= bounds.dq_scale) & (bounds.dq_scale > 0)).any(axis=-1)
        assert np.all(max_probability(case)[is_vacuous] > 0.5)
    else:
        assert vacuous == {"dq": 0, "dk": 0, "dv": 0}
    for grad, fraction in bound_fractions(got, exact, bounds).items():
        assert 0.05 < fraction.max() <= 1, grad


def max_probability(case: BackwardCase) -> np.ndarray:
    """``[B, Sq, Hq]``: each row's largest softmax probability (float64)."""
    f = case.forward
    q, k = f.q.astype(np.float64), np.repeat(f.k.astype(np.float64), f.group_size, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * f.softmax_scale
    s = np.where(visible_all(f), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p.max(axis=-1) / p.sum(axis=-1)).transpose(0, 2, 1)


def distribution_table(dtype: str = "bfloat16") -> dict[str, dict[str, float]]:
    """Max err / bound per dO distribution and gradient (FlashAttention's chain on the gaussian
    score case), the table in docs/backward.md."""
    forward = gaussian_case(dtype, causal=False, S=64).forward
    table = {}
    for name, dist in GRADIENT_DISTRIBUTIONS.items():
        case = build_do(dist, forward, seed=1)
        got, exact, bounds = emulate(case, chain(dtype, "flash"), 64)
        fractions = bound_fractions(got, exact, bounds)
        table[name] = {g: float(fractions[g].max()) for g in GRADS}
        table[name]["vacuous"] = float(sum(bounds.vacuous().values()))
    return table


def test_max_err_over_bound_per_do_distribution() -> None:
    table = distribution_table()
    print("\ndO distribution   dq err/bound  dk err/bound  dv err/bound  vacuous")
    for name, row in table.items():
        print(
            f"{name:<16} {row['dq']:>12.3f} {row['dk']:>13.3f} {row['dv']:>13.3f} "
            f"{int(row['vacuous']):>8d}"
        )
    for name, row in table.items():
        assert all(0.01 < row[g] <= 1 for g in GRADS), (name, row)


@pytest.mark.parametrize(
    ("declared", "actual"),
    [
        ("float16", BackwardPrecision.flash_attention("bfloat16")),  # 16-bit format mix-up
        ("float16", dataclasses.replace(BackwardPrecision.flash_attention("float16"),
                                        output_dtype="bfloat16")),  # outputs rounded to bf16
    ],
)  # fmt: skip
def test_bound_catches_a_chain_other_than_the_declared_one(declared, actual) -> None:
    """fp16 declared, bf16 rounding of P, dS and O (or of the outputs) done: outside."""
    case = gaussian_case("float16", causal=False)
    got = streaming_backward(case, actual, block_m=16, block_n=64)
    exact = exact_backward(case)
    bounds = backward_error_bound(case, chain(declared, "flash"), exact.as_gradients())
    fractions = bound_fractions(got, exact, bounds)
    assert max(float(f.max()) for f in fractions.values()) > 1


def assert_needs_its_own_bound(
    case: BackwardCase,
    base: BackwardPrecision,
    actual: BackwardPrecision,
    *,
    block: int,
    grads: tuple[str, ...] = ("dk",),
) -> None:
    """The emulation of ``actual`` on ``case`` exceeds ``base``'s bound on ``grads`` and stays
    within its own: the chain difference matters, and its bound covers it."""
    got = streaming_backward(case, actual, block_m=block, block_n=block)
    exact = exact_backward(case)
    for declared, outside in ((base, True), (actual, False)):
        fractions = bound_fractions(
            got, exact, backward_error_bound(case, declared, exact.as_gradients())
        )
        assert (max(fractions[g].max() for g in grads) > 1) == outside


def test_ds_from_rounded_p_is_outside_flash_attentions_bound() -> None:
    """dS formed from the 16-bit P adds P's rounding to dS: where 32 identical query rows make
    those errors add up in one dK element, FlashAttention's bound is exceeded (6.5x) and the
    knob's own bound holds, so the knob is needed (the efficient SDPA backend does this)."""
    rng = np.random.default_rng(16)
    q = np.repeat(rng.standard_normal((1, 1, 1, 16)) * 2, 32, axis=1).astype(np.float16)
    k = (rng.standard_normal((1, 8, 1, 16)) * 2).astype(np.float16)
    v = rng.standard_normal((1, 8, 1, 16)).astype(np.float16)
    do = np.repeat(rng.standard_normal((1, 1, 1, 16)), 32, axis=1).astype(np.float16)
    case = BackwardCase(AttentionCase(q, k, v), do)
    base, rounded_p = chain("float16", "flash"), chain("float16", "ds_from_rounded_p")
    assert_needs_its_own_bound(case, base, rounded_p, block=16)


def test_dkv_rounded_per_head_is_outside_flash_attentions_bound() -> None:
    """A GQA decode under the ramp distribution: dk/dv rounded per query head before the group
    sum exceed FlashAttention's bound (about 1.5x, as sdpa's flash backend measured on the
    H200) and stay within the knob's own."""
    forward = Config("float16", D=64, Sq=1, Sk=192, Hq=2, Hkv=1, distribution="ramp", tile_n=64)
    do = np.random.default_rng(0).standard_normal((1, 1, 2, 64)).astype(np.float16)
    case = BackwardCase(forward.build(), do)
    permuted = chain("float16", "permuted")
    per_head = dataclasses.replace(permuted, dkv_rounded_per_head=True)
    assert_needs_its_own_bound(case, permuted, per_head, block=64, grads=("dk", "dv"))


def test_ds_scaled_is_outside_flash_attentions_bound() -> None:
    """A decode row with one key far below the others: its dS is a 16-bit subnormal, and
    rounding scale * dS (as torch SDPA's efficient and cuDNN backends do) loses 1/scale times
    more of it than rounding dS. FlashAttention's bound is exceeded (2.2x), the knob's holds."""
    rng = np.random.default_rng(56)
    q = rng.standard_normal((1, 1, 1, 64)).astype(np.float16)
    k = rng.standard_normal((1, 3, 1, 64))
    k[0, 0, 0] -= q[0, 0, 0].astype(np.float64) * 112 / float(np.sum(q.astype(np.float64) ** 2))
    v, do = (rng.standard_normal((1, n, 1, 64)).astype(np.float16) for n in (3, 1))
    case = BackwardCase(AttentionCase(q, k.astype(np.float16), v), do)
    base, scaled = chain("float16", "flash"), chain("float16", "ds_scaled")
    assert_needs_its_own_bound(case, base, scaled, block=16)


def tiny_do_case(seed: int) -> BackwardCase:
    """Gaussian fp16 scores with dO of about 2^-18: most dS lie in fp16's subnormal range."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 32, 1, 16)).astype(np.float16) for _ in range(3))
    do = (rng.standard_normal((1, 32, 1, 16)) * 2.0**-18).astype(np.float16)
    return BackwardCase(AttentionCase(q, k, v), do)


def test_ds_flushes_subnormals_is_outside_the_scaled_chains_bound() -> None:
    """A flush of the subnormal dS (as sdpa's cuDNN backend does) loses each flushed dS, up to
    the smallest normal, where rounding it would lose half a subnormal step: the scaled chain's
    bound is exceeded (dq 4.9x, dk 6.1x) and the flag's own bound holds (where every dS is
    flushed, as here, it admits dq = dk = 0: those elements are vacuous)."""
    scaled, flushes = chain("float16", "ds_scaled"), chain("float16", "ds_flushes_subnormals")
    assert_needs_its_own_bound(tiny_do_case(0), scaled, flushes, block=16, grads=("dq", "dk"))


def test_flush_to_zero_dv_accumulator_stays_within_the_bound() -> None:
    """dO of 2^-128 makes every product P dO of dv, and dv itself, a subnormal: an fp32
    accumulator that flushes them (GPU tensor cores and conversions may; torch SDPA's cuDNN
    backend missed a float64 dv of -1.5e-39 by 8x the bound without the underflow term, on
    the H200) loses all of dv. The relative gamma_N cannot bound that (51x); the underflow
    term 2 N f does, while an error of 2^7 smallest normals beyond it still fails."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 32, 1, 16)).astype(ml_dtypes.bfloat16) for _ in range(3))
    do = (rng.standard_normal((1, 32, 1, 16)) * 2.0**-128).astype(ml_dtypes.bfloat16)
    case = BackwardCase(AttentionCase(q, k, v), do)
    precision = chain("bfloat16", "ds_flushes_subnormals")
    exact = exact_backward(case)
    assert np.abs(exact.dv).max() < np.finfo(np.float32).tiny  # every dv is subnormal
    got = streaming_backward(case, precision, block_m=16, block_n=16)
    s = q[0, :, 0].astype(np.float64) @ k[0, :, 0].astype(np.float64).T
    s *= case.forward.softmax_scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p = round_to(p / p.sum(axis=1, keepdims=True), "bfloat16")

    def fp32_ftz(x: np.ndarray) -> np.ndarray:  # an fp32 result, flushed below its normals
        return round_to(x, "float32", flush_subnormals=True)

    dv = np.zeros((32, 16))
    for i in range(32):  # dV += P^T dO, one query at a time, every product and sum flushed
        dv = fp32_ftz(dv + fp32_ftz(p[i][:, None] * do[0, i, 0].astype(np.float64)[None, :]))
    assert not dv.any()
    flushed = dataclasses.replace(got, dv=dv.astype(ml_dtypes.bfloat16)[None, :, None, :])
    bounds = backward_error_bound(case, precision, exact.as_gradients())
    assert bound_fractions(flushed, exact, bounds)["dv"].max() <= 1
    off = dataclasses.replace(flushed, dv=flushed.dv + np.finfo(np.float32).tiny * 2**7)
    assert bound_fractions(off, exact, bounds)["dv"].max() > 1


@given(
    backward_cases(max_len=40, max_heads=4, dtypes=("float16",), do_distributions=("tiny",)),
    st.sampled_from([4, 16, 64]),
)
def test_flushing_chain_stays_within_its_bound_on_tiny_do(case: BackwardCase, block_n: int):
    """dO of 2^-20..2^-14 puts fp16's dS in the subnormal range, where the flush acts: the
    flushing emulation stays within the flag's bound on every generated shape and mask."""
    got, exact, bounds = emulate(case, chain("float16", "ds_flushes_subnormals"), block_n)
    for grad, fraction in bound_fractions(got, exact, bounds).items():
        assert np.all(fraction <= 1), f"{grad} block_n={block_n} {case.label}"
        target(float(fraction[np.isfinite(fraction)].max(initial=0)), label=f"{grad} flush")


@given(backward_cases(max_len=12, max_heads=4, mask_kinds=("causal", "window", "varlen")))
def test_elements_nothing_reaches_get_bound_zero(case: BackwardCase) -> None:
    """Empty and padded query rows, and keys no row sees: the kernel must return exactly 0."""
    f = case.forward
    bounds = backward_error_bound(
        case, chain(f.dtype, "flash"), exact_backward(case).as_gradients()
    )
    seen = visible_all(f)  # [B, Hq, Sq, Sk]
    row_reached = seen.any(axis=3).transpose(0, 2, 1)  # [B, Sq, Hq]
    key_reached = np.zeros((f.B, f.Sk, f.Hkv), dtype=bool)
    for h in range(f.Hq):
        key_reached[:, :, f.kv_head(h)] |= seen[:, h].any(axis=1)
    assert np.all(bounds.dq[~row_reached] == 0)
    assert np.all(bounds.dk[~key_reached] == 0) and np.all(bounds.dv[~key_reached] == 0)


def test_float64_chain_bound_is_a_few_float64_ulps() -> None:
    case = gaussian_case("bfloat16", causal=True, S=48)
    got, exact, bounds = emulate(case, BackwardPrecision.float64(), 16)
    for name in GRADS:
        scale = getattr(bounds, f"{name}_scale")
        assert np.all(getattr(bounds, name) <= 1e-11 * scale.max()), name


def test_argument_validation() -> None:
    case = gaussian_case("float16", causal=False, S=4, D=2)
    precision = chain("float16", "flash")
    reference = exact_backward(case).as_gradients()
    with pytest.raises(ValueError, match="case"):
        backward_error_bound(case.forward, precision, reference)
    with pytest.raises(ValueError, match="precision"):
        backward_error_bound(case, precision.forward, reference)
    with pytest.raises(ValueError, match="reference.dk"):
        backward_error_bound(case, precision, dataclasses.replace(reference, dk=reference.dq))
    with pytest.raises(ValueError, match="block_n"):
        backward_error_bound(case, precision, reference, block_n=0)


# --- dq under a common key shift (docs/backward.md, "dq: the errors common to a row") ----------

# huge keys sit at the limit that keeps each q_k k_k finite in fp16; a shift would pass it
SHIFTABLE = tuple(name for name in DISTRIBUTIONS if name != "huge")


def shifted_keys(case: BackwardCase, shift: np.ndarray) -> BackwardCase:
    """``case`` with every key moved by ``shift`` (``[D]``) and rounded to the case's dtype. In
    exact arithmetic the shift adds ``q_i . shift`` to a whole row of scores (P is unchanged)
    and moves dq by ``scale dlse_i shift`` only, since ``sum_j dS_ij = dlse_i``."""
    f = case.forward
    k = (f.k.astype(np.float64) + shift).astype(f.k.dtype)
    forward = dataclasses.replace(f, k=k, label=f"{f.label} keys+{np.abs(shift).max():g}")
    return BackwardCase(forward, case.do, case.dlse, label=f"{case.label} keys shifted")


@st.composite
def shifted_key_cases(draw: st.DrawFn) -> BackwardCase:
    """Backward cases (every mask kind, GQA, dlse, dO distribution) whose keys share a common
    component of 4 to 64 in every coordinate, with random signs."""
    case = draw(backward_cases(max_len=32, max_heads=4, distributions=SHIFTABLE))
    D = case.forward.D
    signs = draw(st.lists(st.sampled_from([1.0, -1.0]), min_size=D, max_size=D))
    return shifted_keys(case, 2.0 ** draw(st.integers(2, 6)) * np.array(signs))


@given(shifted_key_cases(), st.sampled_from(CHAINS), st.sampled_from([4, 16]))
def test_shifted_keys_stay_within_bound(case: BackwardCase, name: str, block_n: int) -> None:
    """Keys with a large common component: each correct chain stays within its bound against
    the exact tier (the project's certified oracle), dq above all, whose row-common terms
    (docs/backward.md) are where a shift could hide an unsound cancellation."""
    got, exact, bounds = emulate(case, chain(case.forward.dtype, name), block_n)
    for grad, fraction in bound_fractions(got, exact, bounds).items():
        assert np.all(fraction <= 1), f"{grad} {name} block_n={block_n} {case.label}"
        finite = fraction[np.isfinite(getattr(bounds, grad))]
        target(float(finite.max(initial=0)), label=f"shifted keys {grad} err / bound")


def test_common_key_shift_grows_a_correct_chains_dq_error() -> None:
    """No dq bound can be invariant to a common key shift: the FlashAttention fp16 chain's dq
    error grows with it (the D error from the 16-bit O times the mean key, and the 16-bit dS's
    rounding errors times the shift do not cancel), past the bound of the unshifted case,
    while staying within the shifted case's own bound."""
    rng = np.random.default_rng(0)
    S, D = 128, 32
    q, v, do = (rng.standard_normal((1, S, 1, D)).astype(np.float16) for _ in range(3))
    keys = np.round(rng.standard_normal((1, S, 1, D)) * 4) / 4  # a grid the shift keeps exact
    shift = 64 * rng.choice([-1.0, 1.0], size=D)
    base = BackwardCase(AttentionCase(q, keys.astype(np.float16), v), do)
    moved = shifted_keys(base, shift)
    assert np.array_equal(moved.forward.k.astype(np.float64), keys + shift)
    precision = chain("float16", "flash")
    base_exact = exact_backward(base)
    unshifted_bound = backward_error_bound(base, precision, base_exact.as_gradients()).dq
    got, exact, bounds = emulate(moved, precision, 64)
    assert np.allclose(exact.dq, base_exact.dq, rtol=1e-12, atol=1e-12 * np.abs(exact.dq).max())
    error = np.abs(got.dq - exact.dq)
    assert (error > unshifted_bound).any()
    assert bound_fractions(got, exact, bounds)["dq"].max() <= 1


def test_ds_rounding_times_a_key_shift_does_not_cancel() -> None:
    """Equal scores over 64 keys moved by +-64, so dq = 0 exactly; dS = x on 3 of 4 keys and
    -3x on the rest with x just below a bf16 rounding midpoint and 3x just above one, so every
    16-bit dS rounds the same way and ``shift * sum_j (dS~ - dS)`` survives: the chain (fp32
    forward, dS rounded to bf16) uses over half of the bound, whose dS rounding term must keep
    ``|k_j|``: with ``|k_j - mean k|`` there (keys centred), this case exceeds it."""
    n, D = 64, 16
    q, do = np.zeros((1, 1, 1, D)), np.zeros((1, 1, 1, D))
    k, v = np.zeros((1, n, 1, D)), np.zeros((1, n, 1, D))
    q[..., -1], do[..., :2] = 1.0, 1.0  # no key has q's coordinate: equal scores
    a = 2.0**-8 - 2.0**-12  # g = 1 + a just below the midpoint of 1 and 1 + 2^-7
    heavy = np.arange(n) % 4 != 3
    v[0, heavy, 0, :2], v[0, ~heavy, 0, :2] = (1.0, a), (-3.0, -3 * a)  # O = 0, D = 0
    k[0, :, 0, :-1] = 64 * np.random.default_rng(0).choice([-1.0, 1.0], size=D - 1)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    case = BackwardCase(AttentionCase(*(x.astype(bf16) for x in (q, k, v))), do.astype(bf16))
    precision = BackwardPrecision(
        forward=StreamingPrecision.flash_attention("float32"), ds_dtype="bfloat16"
    )
    got, exact, bounds = emulate(case, precision, 16)
    assert np.all(exact.dq == 0)
    assert 0.5 < bound_fractions(got, exact, bounds)["dq"].max() <= 1


@pytest.mark.parametrize(
    ("dtype", "block_n", "middle"), [("bfloat16", 128, 2.0**-15), ("float16", 64, 2.0**-17)]
)
def test_16_bit_dq_accumulator_is_flagged(dtype: str, block_n: int, middle: float) -> None:
    """1024 keys: the FlashAttention chain with dQ accumulated in the input dtype across K blocks
    exceeds the dq bound (the lost terms are several times the bound), the fp32 accumulator
    stays well within it."""
    case = swamped_dq_case(dtype, 1024, middle)
    precision = chain(dtype, "flash")
    exact = exact_backward(case)
    bounds = backward_error_bound(case, precision, exact.as_gradients(), block_n=block_n)
    edits = [Mutation(MODULE, *edit) for edit in SOURCE_EDITS["dq_16bit_accumulator"]]
    mutant = mutated_module(MODULE, edits, "dq16")
    for backward, flagged in ((streaming_backward, False), (mutant.streaming_backward, True)):
        got = backward(case, precision, block_m=16, block_n=block_n)
        worst = bound_fractions(got, exact, bounds)["dq"].max()
        assert (worst > 2) if flagged else (worst < 0.1), (backward.__module__, worst)
