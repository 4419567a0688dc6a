"""Softcap through every layer: case model, exact tier, streaming tier, bound, strategies.

Convention (docs/forward-surface.md): ``logit = softcap * tanh(softmax_scale * q.k / softcap)``,
the scale inside the cap, as flash_attn.cute's softcap score_mod sees the scaled scores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from mpmath.libmp import from_man_exp, mpf_sub, mpf_tanh, to_float

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.surface import SURFACES, surface_cases, surface_of
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import (
    TANH_ERROR_BOUND,
    exact_attention,
    naive_exact_attention,
)
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import FLOAT64_PRECISION, streaming_attention
from attention_crossval.report.configs import Config
from attention_crossval.testing.mutants_surface import SURFACE_SPEC, surface_reference_cases

pytestmark = pytest.mark.cpu

SOFTCAP_SURFACES = ("softcap", "softcap_saturated")


def _case(softcap: float | None, scale: float = 0.5, seed: int = 0) -> AttentionCase:
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((1, n, 2, 8)).astype(np.float16) * 4 for n in (3, 7))
    v = rng.standard_normal((1, 7, 2, 4)).astype(np.float16)
    return AttentionCase(q, k, v, scale, Mask(causal=True), softcap=softcap)


@pytest.mark.parametrize("softcap", [0.0, -1.0, math.inf, math.nan, True, "5"])
def test_invalid_softcap_is_rejected(softcap) -> None:
    with pytest.raises(ValueError, match="softcap="):
        _case(softcap)


def test_softcap_round_trips_through_npz(tmp_path) -> None:
    case = _case(5.0)
    loaded = AttentionCase.load(case.save(tmp_path / "case.npz"))
    assert loaded.softcap == 5.0 and "softcap=5" in loaded.describe()
    assert AttentionCase.load(_case(None).save(tmp_path / "plain.npz")).softcap is None


def test_the_scale_enters_before_the_cap() -> None:
    """Against a direct float64 formula: scale, then cap (the other order gives other logits)."""
    case = _case(2.0, scale=0.5)
    q, k, v = (x.astype(np.float64) for x in (case.q, case.k, case.v))
    logits = 2.0 * np.tanh(0.5 * np.einsum("bihd,bjhd->bhij", q, k) / 2.0)
    logits = np.where(np.tril(np.ones((3, 7)), 4) > 0, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    expected = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)
    exact = exact_attention(case)
    np.testing.assert_allclose(exact.o, expected, rtol=0, atol=1e-13)
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(exact.lse, lse, rtol=1e-14)


@given(surface_reference_cases(SOFTCAP_SURFACES, max_len=5, max_heads=2, max_batch=1))
def test_exact_matches_the_naive_loop(case: AttentionCase) -> None:
    """The naive loop (mpmath tanh at 100 digits, rounded once to double) lies within half an
    ulp plus the certified bound of the fixed-point tier."""
    exact, naive = exact_attention(case), naive_exact_attention(case)
    allowed = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    assert np.all(np.abs(exact.o + exact.o_lo - naive.o) <= allowed + np.spacing(np.abs(naive.o)))
    finite = np.isfinite(naive.lse)
    assert np.array_equal(finite, np.isfinite(exact.lse))
    err = np.abs(exact.lse[finite] - naive.lse[finite])
    assert np.all(err <= exact.lse_err_bound[finite] + np.spacing(np.abs(naive.lse[finite])))


def test_mpf_tanh_meets_the_assumed_error_bound() -> None:
    """The certificate assumes |mpf_tanh(x, W) - tanh(x)| <= TANH_ERROR_BOUND 2^-W; sample it
    against a 2W + 20-bit evaluation over the saturating range too."""
    rng = np.random.default_rng(7)
    for W in (144, 200):
        worst = 0.0
        for x in rng.standard_normal(300) * rng.choice([0.01, 1.0, 30.0], 300):
            num, den = float(x).as_integer_ratio()
            arg = from_man_exp(num, 1 - den.bit_length())
            diff = mpf_sub(mpf_tanh(arg, W), mpf_tanh(arg, 2 * W + 20), 2 * W + 20)
            worst = max(worst, abs(to_float(diff)))
        assert math.ldexp(worst, W) <= TANH_ERROR_BOUND


@given(surface_reference_cases(SOFTCAP_SURFACES, max_len=20))
def test_float64_streaming_matches_exact(case: AttentionCase) -> None:
    with np.errstate(all="ignore"):  # the ulps of an exact 0 overflow too
        exact = exact_attention(case)
        got = streaming_attention(case, block_m=4, block_n=8)
        bound = error_bound(case, exact.as_result(), FLOAT64_PRECISION, block_n=8)
        lse_bound = lse_error_bound(case, exact.as_result(), FLOAT64_PRECISION, block_n=8)
        assert_within_bound(got, exact, bound, output_dtype="float64", lse_bound=lse_bound)


@given(surface_reference_cases(SOFTCAP_SURFACES, max_len=40, dtypes=("float16", "bfloat16")))
def test_emulated_chain_stays_within_the_derived_bound(case: AttentionCase) -> None:
    """FlashAttention's chain (fp32 S and tanh, P in 16 bits, FA4 threshold) against exact."""
    precision = StreamingPrecision.flash_attention(case.dtype, rescale_threshold_log2=8.0)
    with np.errstate(all="ignore"):  # the ulps of an exact 0 overflow too
        exact = exact_attention(case)
        got = streaming_attention(case, precision, block_m=16, block_n=8, reverse_kv_order=True)
        bound = error_bound(case, exact.as_result(), precision, block_n=8)
        lse_bound = lse_error_bound(case, exact.as_result(), precision, block_n=8)
        assert_within_bound(got, exact, bound, output_dtype=case.dtype, lse_bound=lse_bound)


def test_tanh_error_widens_the_bound_and_is_validated() -> None:
    """A kernel on tanh.approx.f32 (relative error 2^-11 = 4096 ulp of fp32) declares it; the
    bound grows with it, and a nonsense value is refused."""
    case = _case(5.0)
    ref = exact_attention(case).as_result()
    precision = StreamingPrecision.flash_attention("float16")
    tight = error_bound(case, ref, precision, block_n=8)
    loose = error_bound(case, ref, precision, block_n=8, tanh_error_ulp=4096)
    assert (loose >= tight).all() and (loose > tight).any()
    with pytest.raises(ValueError, match="tanh_error_ulp"):
        lse_error_bound(case, ref, precision, block_n=8, tanh_error_ulp=-1)


@given(surface_reference_cases(("softcap_saturated",), max_len=20))
def test_saturated_cases_saturate(case: AttentionCase) -> None:
    """The claim: at least half of the visible logits lie beyond SATURATION caps (near-ties)."""
    assert surface_of(case) is SURFACES["softcap_saturated"]
    evidence = SURFACES["softcap_saturated"].claim(case)
    assert evidence.failure is None, evidence.failure


def test_saturation_claim_rejects_an_unsaturated_cap() -> None:
    case = _case(1e3)  # |logits| ~ 10, far below SATURATION caps
    assert SURFACES["softcap_saturated"].claim(case).failure is not None


def test_softcap_cases_need_a_spec_that_declares_them() -> None:
    plain = KernelSpec(
        name="plain",
        dtypes=frozenset({"float16"}),
        head_dims=frozenset({8}),
        head_dims_v=frozenset({4}),
        mask_kinds=frozenset({"causal"}),
    )
    assert plain.unsupported(_case(5.0)) == "softcap not supported"
    assert plain.supports(_case(None))
    assert SURFACE_SPEC.supports(_case(5.0))
    with pytest.raises(ValueError, match="declared by the spec"):
        surface_cases(attention_cases(), spec=plain, surfaces=("softcap",))
    with pytest.raises(ValueError, match="must be names"):
        surface_cases(attention_cases(), spec=SURFACE_SPEC, surfaces=("softcapp",))


def test_report_config_carries_softcap_and_sink() -> None:
    plain = Config("float16", 64, 5, 9)
    # Unset fields stay out of the recipe: existing configs keep their digest and inputs.
    assert "softcap" not in plain.fields() and plain.digest == "d3870fc04ada4893"
    config = Config("float16", 64, 5, 9, softcap=30.0, sink=2.5)
    case = config.build()
    assert case.softcap == 30.0 and case.sink.tolist() == [2.5, 2.5]
    assert config.name == "fp16-d64-q5-k9-none-gaussian-cap30-sink2.5"
    for bad in (dict(softcap=0.0), dict(softcap=True), dict(sink=math.inf), dict(sink=1e39)):
        with pytest.raises(ValueError, match=f"config.{next(iter(bad))}="):
            Config("float16", 64, 5, 9, **bad)
