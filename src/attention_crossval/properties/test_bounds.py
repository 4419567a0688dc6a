"""Properties of the derived error bound (reference/bounds.py): docs/numerics.md#tightness in
miniature.

The streaming tier in emulated fp16/bf16 precision must stay inside ``error_bound`` against the
float64 reference on every input family that stresses one term of the bound; the bound must not
be absurdly loose; and it must be *needed*: a fixed torch-style tolerance rejects correct runs
and accepts a broken precision chain that the bound catches.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, target
from hypothesis import strategies as st

import attention_crossval.reference.bounds as bounds_module
import attention_crossval.reference.streaming as streaming_module
from attention_crossval.reference.bounds import (
    error_bound,
    forward_error_bounds,
    lse_error_bound,
    visible_v_range,
)
from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import assert_within_bound, compare
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.masks import empty_rows, visible_all
from attention_crossval.reference.precision import StreamingPrecision, round_to
from attention_crossval.reference.streaming import streaming_attention

pytestmark = pytest.mark.cpu

FLOAT64 = StreamingPrecision.float64()
FAMILIES = ("normal", "peaky", "ramp", "flat", "v_offset", "masked_rows", "tiny_tail")
# the three chain variants of docs/numerics.md#tightness, plus FA4's stale max (rescale only
# past 2^8 growth).
VARIANTS = ("flash", "rounded_p_sum", "fp32_out", "threshold")
# torch.testing.assert_close defaults (rtol, atol) per output dtype.
TORCH_TOLERANCE = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5)}


def family_case(
    family: str, dtype: str, *, Sq: int, Sk: int, D: int, Hkv: int, group: int, seed: int
) -> AttentionCase:
    """One input family of docs/numerics.md#tightness, built from ``seed`` with NumPy (values
    rounded to
    ``dtype``). Each stresses a term of the bound:

    * normal: Q, K ~ N(0, 1.5), V ~ N(0, 1); peaky: Q, K ~ N(0, 6) (large |s|, the u32 c|s| terms);
    * ramp: scores grow with the key index, a new row max in every block (the alpha rescales);
    * flat: all keys but one identical, so their p_j are equal and their rounding errors
      correlate (biased rounding, arXiv:2510.04212);
    * v_offset: V ~ 100 + N(0, 1) (|v - o| << |v|: which P the row sum adds matters);
    * masked_rows: a random explicit mask with some fully masked rows (bound 0 there);
    * tiny_tail: one dominant key, the others 14..24 log2 units below (fp16-subnormal P).
    """
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q = rng.normal(0, 1.5, (1, Sq, Hq, D))
    k = rng.normal(0, 1.5, (1, Sk, Hkv, D))
    v = rng.normal(0, 1, (1, Sk, Hkv, D))
    mask = Mask()
    scale_log2 = math.log2(math.e) / math.sqrt(D)
    if family == "peaky":
        q, k = 4 * q, 4 * k
    elif family == "ramp":
        q[..., 0] = 4.0
        k[..., 0] = np.linspace(0, 6, Sk)[None, :, None] + rng.normal(0, 0.05, (1, Sk, Hkv))
    elif family == "flat":
        k[:] = k[:, :1]
        k[:, 0, :, 0] += 1.0  # key 0 apart: the others share one p (rarely a 16-bit value)
    elif family == "v_offset":
        v += 100
    elif family == "masked_rows":
        explicit = rng.random((1, 1, Sq, Sk)) < 0.7
        explicit[:, :, rng.random(Sq) < 0.3, :] = False
        mask = Mask(explicit=explicit)
    elif family == "tiny_tail":
        q[:] = 0
        q[..., 0] = 1.0
        gap_log2 = rng.uniform(14, 24, (1, Sk, Hkv))
        gap_log2[:, rng.integers(Sk)] = 0
        k[..., 0] = 8 - gap_log2 / scale_log2
    cast = INPUT_DTYPES[dtype]
    return AttentionCase(q.astype(cast), k.astype(cast), v.astype(cast), mask=mask, label=family)


def chain(dtype: str, variant: str) -> StreamingPrecision:
    base = StreamingPrecision.flash_attention(dtype)
    if variant == "rounded_p_sum":
        return StreamingPrecision(p_dtype=dtype, row_sum_from_rounded_p=True, output_dtype=dtype)
    if variant == "fp32_out":
        return StreamingPrecision(p_dtype=dtype)
    if variant == "threshold":
        return StreamingPrecision.flash_attention(dtype, rescale_threshold_log2=8.0)
    return base


def total_bound(case: AttentionCase, ref: AttentionResult, precision, block_n: int) -> np.ndarray:
    """The kernel chain's bound plus the float64 reference's own bound (triangle inequality),
    so the check against a float64 (not exact) reference stays rigorous."""
    return error_bound(case, ref, precision, block_n=block_n) + error_bound(
        case, ref, FLOAT64, block_n=block_n
    )


def bound_ratios(family: str, dtype: str, variant: str, *, seed: int = 0, **shape) -> np.ndarray:
    """err / bound of the emulated chain against float64 over non-empty elements."""
    shape = {"Sq": 16, "Sk": 384, "D": 64, "Hkv": 1, "group": 1} | shape
    case = family_case(family, dtype, seed=seed, **shape)
    ref = streaming_attention(case)
    precision = chain(dtype, variant)
    got = streaming_attention(case, precision, block_m=16, block_n=64)
    bound = total_bound(case, ref, precision, 64)
    live = bound > 0
    return np.abs(got.o - ref.o)[live] / bound[live]


@st.composite
def family_runs(draw):
    family = draw(st.sampled_from(FAMILIES))
    dtype = draw(st.sampled_from(["float16", "bfloat16"]))
    variant = draw(st.sampled_from(VARIANTS))
    shape = dict(
        Sq=draw(st.integers(1, 12)),
        Sk=draw(st.integers(1, 300)),
        D=draw(st.sampled_from([8, 32, 64])),
        Hkv=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 2)),
    )
    block_m, block_n = draw(st.sampled_from([4, 16])), draw(st.sampled_from([16, 32, 64]))
    seed = draw(st.integers(0, 2**32 - 1))
    reverse = draw(st.booleans())
    return family, dtype, variant, shape, block_m, block_n, seed, reverse


@given(family_runs())
@example(("peaky", "bfloat16", "flash", dict(Sq=8, Sk=300, D=64, Hkv=1, group=1), 4, 64, 1, 0))
@example(
    ("tiny_tail", "float16", "fp32_out", dict(Sq=4, Sk=257, D=32, Hkv=1, group=2), 4, 16, 2, 1)
)
def test_emulated_chain_stays_within_bound(run) -> None:
    family, dtype, variant, shape, block_m, block_n, seed, reverse = run
    case = family_case(family, dtype, seed=seed, **shape)
    precision = chain(dtype, variant)
    ref = streaming_attention(case)
    got = streaming_attention(
        case, precision, block_m=block_m, block_n=block_n, reverse_kv_order=reverse
    )
    bound = total_bound(case, ref, precision, block_n)
    lse_bound = lse_error_bound(case, ref, precision, block_n=block_n)
    lse_bound += lse_error_bound(case, ref, FLOAT64, block_n=block_n)
    reproducer = f"family_case({family!r}, {dtype!r}, seed={seed}, **{shape}); {variant}"
    report = assert_within_bound(
        got, ref, bound, output_dtype=dtype, lse_bound=lse_bound, reproducer=reproducer
    )
    if report.max_bound_fraction:
        target(report.max_bound_fraction, label="err / bound")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bound_is_not_absurdly_loose(dtype: str) -> None:
    """Per family the worst element uses a visible share of the bound, and the chain's error
    reaches a third of it somewhere (docs/numerics.md#tightness: 0.05 to 0.54 measured with a
    perturbed
    exp2; this emulation's exp2 is exact, so its errors are a little smaller)."""
    worst = {
        family: max(float(bound_ratios(family, dtype, v).max(initial=0)) for v in VARIANTS)
        for family in FAMILIES
    }
    assert min(worst.values()) > 1e-2, worst
    assert max(worst.values()) > 0.25, worst


def test_float64_chain_bound_is_a_few_ulps_of_float64() -> None:
    """The float64 mode's bound is ~ Sk 2^-53 sum p|v| / l, and float64 streaming (any block
    size) stays inside it against another block size."""
    case = family_case("normal", "float32", Sq=8, Sk=200, D=32, Hkv=1, group=1, seed=3)
    ref = streaming_attention(case, block_n=200)
    bound = error_bound(case, ref, FLOAT64, block_n=7)
    assert np.all(bound < 200 * 2.0**-50 * np.abs(case.v).max()), bound.max()
    assert np.all(bound > 2.0**-53 * np.abs(ref.o))
    got = streaming_attention(case, block_m=3, block_n=7)
    assert_within_bound(got, ref, 2 * bound, output_dtype="float64")


def test_empty_rows_get_zero_bound() -> None:
    case = family_case("masked_rows", "bfloat16", Sq=12, Sk=40, D=8, Hkv=1, group=2, seed=5)
    ref = streaming_attention(case)
    bound = error_bound(case, ref, chain("bfloat16", "flash"), block_n=16)
    lse_bound = lse_error_bound(case, ref, chain("bfloat16", "flash"), block_n=16)
    empty = empty_rows(case)  # [B, Hq, Sq]
    assert empty.any() and (~empty).any()
    assert np.all(bound.transpose(0, 2, 1, 3)[empty] == 0)
    assert np.all(lse_bound[empty] == 0)
    assert np.all(bound.transpose(0, 2, 1, 3)[~empty] > 0)


def test_one_pass_gives_both_bounds_bit_for_bit() -> None:
    """forward_error_bounds (one pass over the row chunks) returns exactly what error_bound and
    lse_error_bound return apart, on a case with empty rows, GQA and a NaN reference O."""
    case = family_case("masked_rows", "bfloat16", Sq=12, Sk=40, D=8, Hkv=1, group=2, seed=5)
    ref = streaming_attention(case)
    ref = AttentionResult(
        o=np.where(np.arange(case.Sq)[:, None, None] % 3, ref.o, np.nan), lse=ref.lse
    )
    options = dict(block_n=16, kv_order="forward", num_splits=2)
    precision = chain("bfloat16", "flash")
    both = forward_error_bounds(case, ref, precision, **options)
    np.testing.assert_array_equal(both[0], error_bound(case, ref, precision, **options))
    np.testing.assert_array_equal(both[1], lse_error_bound(case, ref, precision, **options))


def test_kv_order_any_covers_forward_and_reverse() -> None:
    case = family_case("ramp", "float16", Sq=4, Sk=256, D=32, Hkv=1, group=1, seed=0)
    ref = streaming_attention(case)
    precision = StreamingPrecision(p_dtype="float16", row_sum_from_rounded_p=True)
    per_order = {
        order: error_bound(case, ref, precision, block_n=32, kv_order=order)
        for order in ("forward", "reverse", "any")
    }
    assert np.all(per_order["any"] >= per_order["forward"])
    assert np.all(per_order["any"] >= per_order["reverse"])
    assert np.any(per_order["any"] > per_order["forward"])


def test_a_fixed_torch_tolerance_rejects_a_correct_run() -> None:
    """On N(0,1) data some outputs are near 0, where a relative tolerance is meaningless: the
    correct bf16 chain fails torch's (rtol, atol) somewhere but never the derived bound."""
    dtype = "bfloat16"
    case = family_case("normal", dtype, Sq=16, Sk=384, D=64, Hkv=1, group=1, seed=0)
    ref = streaming_attention(case)
    precision = chain(dtype, "flash")
    got = streaming_attention(case, precision, block_n=64)
    assert_within_bound(got, ref, total_bound(case, ref, precision, 64), output_dtype=dtype)
    rtol, atol = TORCH_TOLERANCE[dtype]
    assert np.any(np.abs(got.o - ref.o) > atol + rtol * np.abs(ref.o))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bound_catches_p_biased_by_one_ulp(dtype: str, monkeypatch) -> None:
    """A broken chain that rounds P *up* to the next 16-bit value (1 ulp of P, systematically)
    violates the bound on V-offset data with fp32 output, while torch's tolerance lets it pass
    for bf16: a fixed tolerance cannot tell this bug from rounding."""

    def round_p_up(x: np.ndarray, to: str) -> np.ndarray:
        rounded = round_to(x, to)
        if to != dtype:
            return rounded
        native = INPUT_DTYPES[dtype]
        up = np.nextafter(rounded.astype(native), np.array(np.inf, native)).astype(np.float64)
        return np.where((rounded != 0) & np.isfinite(rounded), up, rounded)

    case = family_case("v_offset", dtype, Sq=16, Sk=384, D=64, Hkv=1, group=1, seed=0)
    ref = streaming_attention(case)
    precision = chain(dtype, "fp32_out")
    bound = total_bound(case, ref, precision, 64)
    honest = streaming_attention(case, precision, block_n=64)
    assert compare(honest, ref, bound=bound, output_dtype="float32").passed
    monkeypatch.setattr(streaming_module, "round_to", round_p_up)
    broken = streaming_attention(case, precision, block_n=64)
    with pytest.raises(AssertionError, match="mismatched"):
        assert_within_bound(broken, ref, bound, output_dtype="float32")
    if dtype == "bfloat16":
        rtol, atol = TORCH_TOLERANCE[dtype]
        assert np.all(np.abs(broken.o - ref.o) <= atol + rtol * np.abs(ref.o))


@pytest.mark.parametrize("family", ["peaky", "tiny_tail", "v_offset"])
def test_bound_holds_against_the_exact_tier(family: str) -> None:
    """Against the certified tier (no float64 reference error to add), ulps counted from the
    correctly rounded double-double: the bf16 chain stays within error_bound."""
    case = family_case(family, "bfloat16", Sq=6, Sk=150, D=16, Hkv=1, group=2, seed=7)
    ref = exact_attention(case)
    precision = chain("bfloat16", "rounded_p_sum")
    got = streaming_attention(case, precision, block_m=4, block_n=32)
    bound = error_bound(case, ref.as_result(), precision, block_n=32)
    lse_bound = lse_error_bound(case, ref.as_result(), precision, block_n=32)
    report = assert_within_bound(got, ref, bound, output_dtype="bfloat16", lse_bound=lse_bound)
    assert report.total == got.o.size and report.max_ulp <= 2


@pytest.mark.parametrize(("Sq", "Sk"), [(0, 5), (3, 0), (1, 1)])
def test_degenerate_lengths(Sq: int, Sk: int) -> None:
    """No query rows or no keys at all: every row is empty (bound 0), nothing divides by 0."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, Sq, 2, 4)), rng.normal(size=(1, Sk, 1, 4))
    case = AttentionCase(q.astype(np.float16), k.astype(np.float16), k.astype(np.float16))
    ref = streaming_attention(case)
    precision = chain("float16", "flash")
    bound = error_bound(case, ref, precision, block_n=4)
    assert bound.shape == ref.o.shape
    assert np.all((bound > 0) == (Sq * Sk > 0))
    assert lse_error_bound(case, ref, precision, block_n=4).shape == (1, 2, Sq)


def huge_logit_case(logit: float, Sk: int = 8) -> AttentionCase:
    """One fp32 query row whose keys score ``logit`` and ``logit - 1``: the exp2 argument's
    rounding (relative to |logit|) makes every weight uncertain by a share growing with it."""
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.full((1, Sk, 1, 1), logit - 1.0, np.float32)
    k[0, 0, 0, 0] = logit
    v = np.linspace(-1.0, 1.0, Sk).reshape(1, Sk, 1, 1).astype(np.float32)
    return AttentionCase(q, k, v, softmax_scale=1.0)


def test_bound_covers_adversarial_weights_when_their_error_is_not_small() -> None:
    """With weights uncertain by rel = sum w / l ~ 0.95, the worst kernel scales the weights on
    one side of o by their whole factor (each weight is ``p e^theta``, ``|theta| <= ln(1 +
    eta)``): a first-order factor 1.01 misses that (the LSE bound was 1.68 against an error of
    3.02). From rel >= 1 on (logit 4e6) the row sum still has the multiplicative floor
    ``sum p / (1 + eta)``, so the bound stays finite and covers the same adversaries."""
    precision = StreamingPrecision.flash_attention("float32")
    chain_ = bounds_module._Chain.of(precision, 2.0, 2.0**-23)
    for logit, rel in ((2e6, (0.5, 1)), (4e6, (1, 4))):
        case = huge_logit_case(logit)
        chunk = next(bounds_module._row_chunks(case, chain_, 128, "any"))
        p, w, v = chunk.p[0], chunk.w_common[0], case.v[0, :, 0, 0].astype(np.float64)
        factor = 1 + (w - chain_.ftz) / p  # 1 + eta
        o = p @ v / p.sum()
        assert rel[0] < w.sum() / p.sum() < rel[1]
        ref = streaming_attention(case)
        bound = error_bound(case, ref, precision, block_n=128)[0, 0, 0, 0]
        lse_bound = lse_error_bound(case, ref, precision, block_n=128)[0, 0, 0]
        assert np.isfinite(bound) and np.isfinite(lse_bound)
        for side in (v < o, v > o, v == v):
            for tilde in (np.where(side, p / factor, p), np.where(side, p * factor, p)):
                assert abs(tilde @ v / tilde.sum() - o) <= bound
                assert abs(np.log(tilde.sum() / p.sum())) <= lse_bound


def test_visible_v_range_is_the_spread_over_visible_keys() -> None:
    case = family_case("masked_rows", "bfloat16", Sq=12, Sk=40, D=8, Hkv=1, group=2, seed=5)
    got = visible_v_range(case)
    seen = visible_all(case)  # [B, Hq, Sq, Sk]
    v = np.repeat(case.v.astype(np.float64), case.group_size, axis=2)  # [B, Sk, Hq, Dv]
    for b, h, i in np.ndindex(*got.shape):
        keys = seen[b, h, i]
        want = np.ptp(v[b, keys, h, :], axis=0).max() if keys.any() else 0.0
        assert got[b, h, i] == want
    assert (got == 0).any() and (got > 0).any()


def test_visible_v_range_reads_the_dequantized_v() -> None:
    """An FP8 case's O is made of ``v * v_descale``: its vacuous-bound range is that V's (the
    raw FP8 range was counted, about 100 times too wide under an amax descale)."""
    rng = np.random.default_rng(3)
    q, k = (round_to(rng.standard_normal((1, S, 1, 16)), "float8_e4m3fn") for S in (4, 9))
    v = round_to(100 * rng.standard_normal((1, 9, 1, 16)), "float8_e4m3fn")
    arrays = [a.astype(INPUT_DTYPES["float8_e4m3fn"]) for a in (q, k, v)]
    raw = visible_v_range(AttentionCase(*arrays))
    descaled = AttentionCase(*arrays, v_descale=np.full((1, 1), 0.01, np.float32))
    np.testing.assert_allclose(visible_v_range(descaled), raw * np.float32(0.01), rtol=1e-15)
    assert (raw > 0).all()
