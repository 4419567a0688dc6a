"""Learnable sink through every layer: case model, exact tier, streaming tier, bound, strategies.

Convention (docs/forward-surface.md): one logit per query head in the softmax denominator, with
no value, in natural-log units (neither scaled nor capped); a row that sees no key has O = 0 and
LSE = sink (flash_attn.cute's measured behaviour).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from attention_crossval.kernel.adapters.streaming import StreamingAdapter, create
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.properties._strategies.surface import SURFACES, surface_of
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention, naive_exact_attention
from attention_crossval.reference.masks import empty_rows
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.testing.mutants_surface import surface_reference_cases

pytestmark = pytest.mark.cpu

SINK_SURFACES = ("sink", "sink_dominant", "sink_below", "softcap+sink")


def _case(sink, softcap: float | None = None, k_lengths=(5, 0)) -> AttentionCase:
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float16)
    k = rng.standard_normal((2, 5, 1, 8)).astype(np.float16)
    v = rng.standard_normal((2, 5, 1, 4)).astype(np.float16)
    mask = Mask(causal=True, k_lengths=k_lengths)
    return AttentionCase(q, k, v, mask=mask, softcap=softcap, sink=sink)


@pytest.mark.parametrize(
    "sink",
    [
        np.zeros(3, np.float32),  # one per query head: Hq = 2
        np.zeros((2, 1), np.float32),
        np.array([0, 1]),  # ints: not a float array
        np.array([np.inf, 0], np.float32),
        np.array([0.1, 0.0]),  # float64 0.1 is not a float32 value
    ],
)
def test_invalid_sink_is_rejected(sink) -> None:
    with pytest.raises(ValueError, match="sink"):
        _case(sink)


def test_sink_round_trips_through_npz(tmp_path) -> None:
    case = _case(np.array([0.5, -2.0], np.float32), softcap=30.0)
    loaded = AttentionCase.load(case.save(tmp_path / "case.npz"))
    assert loaded.sink.dtype == np.float32 and loaded.sink.tolist() == [0.5, -2.0]
    assert loaded.softcap == 30.0 and "sink=[0.5, -2.0]" in loaded.describe()


@pytest.mark.parametrize(
    "precision", [StreamingPrecision.float64(), StreamingPrecision.flash_attention("float16")]
)
def test_rows_that_see_no_key_give_zero_output_and_the_sink_as_lse(precision) -> None:
    """Batch 1 has no keys (and padded query rows with B = 2 k_lengths): O = 0, LSE = sink."""
    sink = np.array([1.5, -7.25], np.float32)
    case = _case(sink, k_lengths=(5, 0))
    empty = empty_rows(case)
    assert empty[1].all() and not empty[0].all()
    exact = exact_attention(case)
    got = streaming_attention(case, precision, block_m=2, block_n=2)
    for result in (exact, got):
        assert (result.o.transpose(0, 2, 1, 3)[empty] == 0).all()
    expected = np.broadcast_to(sink[None, :, None], empty.shape)[empty]
    assert (exact.lse[empty] == expected).all()
    np.testing.assert_allclose(got.lse[empty], expected, rtol=2**-20)


@given(surface_reference_cases(SINK_SURFACES, max_len=5, max_heads=2, max_batch=1))
def test_exact_matches_the_naive_loop(case: AttentionCase) -> None:
    """The naive loop (the sink as one more term of the sum, 100 digits, rounded once) lies
    within half an ulp plus the certified bound of the fixed-point tier."""
    exact, naive = exact_attention(case), naive_exact_attention(case)
    allowed = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    allowed = allowed + np.spacing(np.abs(naive.o))
    assert np.all(np.abs(exact.o + exact.o_lo - naive.o) <= allowed)
    assert np.all(
        np.abs(exact.lse - naive.lse) <= exact.lse_err_bound + np.spacing(np.abs(naive.lse))
    )


@given(surface_reference_cases(SINK_SURFACES, max_len=40))
def test_emulated_chain_stays_within_the_derived_bound(case: AttentionCase) -> None:
    """FlashAttention's chain with the sink as the loop's starting state, against exact."""
    precision = StreamingPrecision.flash_attention(case.dtype, rescale_threshold_log2=8.0)
    with np.errstate(all="ignore"):  # the ulps of an exact 0 overflow too
        exact = exact_attention(case)
        got = streaming_attention(case, precision, block_m=16, block_n=8)
        bound = error_bound(case, exact.as_result(), precision, block_n=8)
        lse_bound = lse_error_bound(case, exact.as_result(), precision, block_n=8)
        assert_within_bound(got, exact, bound, output_dtype=case.dtype, lse_bound=lse_bound)


@given(surface_reference_cases(("sink_dominant", "sink_below"), max_len=20))
def test_adversarial_sinks_prove_their_claim(case: AttentionCase) -> None:
    surface = surface_of(case)
    evidence = surface.claim(case)
    assert evidence.failure is None, evidence.failure
    if surface.name == "sink_dominant" and evidence.applicable:
        # O ~ 0 and LSE ~ sink on every row, exactly what the claim promises.
        exact = exact_attention(case)
        v_max = np.abs(np.nan_to_num(case.v.astype(np.float64))).max(initial=1.0)
        assert np.abs(exact.o).max() <= case.Sk * np.exp(-20 + 1e-3) * v_max
        sink = np.broadcast_to(case.sink[None, :, None], exact.lse.shape)
        allowed = case.Sk * np.exp(-20 + 1e-3) + exact.lse_err_bound + np.spacing(np.abs(sink))
        assert np.all(exact.lse - sink <= allowed)


def test_claims_reject_cases_that_miss_them() -> None:
    assert SURFACES["sink_dominant"].claim(_case(np.zeros(2, np.float32))).failure is not None
    assert SURFACES["sink_below"].claim(_case(np.full(2, 50.0, np.float32))).failure is not None


def _harness_case() -> AttentionCase:
    """streaming-fa's head dims; batch 1 has no keys, so its rows are empty (LSE = sink)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 9, 2, 16)).astype(np.float16)
    k = rng.standard_normal((2, 70, 1, 16)).astype(np.float16)
    v = rng.standard_normal((2, 70, 1, 16)).astype(np.float16)
    mask = Mask(causal=True, q_lengths=(9, 4), k_lengths=(70, 0))
    sink = np.array([0.75, -3.5], np.float32)
    return AttentionCase(q, k, v, mask=mask, softcap=30.0, sink=sink)


def test_streaming_kernel_passes_a_sink_case_under_the_harness() -> None:
    verdict = run_case(create(), _harness_case())
    assert verdict.passed, [str(f) for f in verdict.findings]


def test_a_kernel_that_forgets_the_sink_on_empty_rows_is_found() -> None:
    """LSE = -inf on empty rows (the no-sink convention) is an empty-rows finding."""

    class ForgetsSink(StreamingAdapter):
        def __call__(self, case: AttentionCase):
            result = super().__call__(case)
            lse = np.where(empty_rows(case), -np.inf, result.lse)
            return AttentionResult(o=result.o, lse=lse)

    verdict = run_case(ForgetsSink(), _harness_case())
    assert verdict.failed("empty-rows"), [str(f) for f in verdict.findings]
