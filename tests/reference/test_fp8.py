"""FP8 inputs through the three tiers (docs/fp8.md): the case model and its validation, the
exact tier on dequantized values, the FP8 chain's bound against the exact tier on the default
strategies, the creeping-max trigger's skipped rescales and clamped P, a saturating chain's
undefined bound, and the CPU FP8 mutants (testing/broken/cpu_fp8.py) on their trigger cases.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.harness.references import reference_findings
from attention_crossval.properties._strategies.fp8 import creeping_max, quantize
from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.bounds import error_bound, lse_error_bound, saturating_rows
from attention_crossval.reference.case import FP8_DTYPES, AttentionCase
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention, naive_exact_attention
from attention_crossval.reference.precision import StreamingPrecision, round_to
from attention_crossval.reference.rowwise import rowwise_attention
from attention_crossval.reference.streaming import RescaleTrace, streaming_attention
from attention_crossval.report.configs import Config, preset
from attention_crossval.testing.broken import cpu_fp8

pytestmark = pytest.mark.cpu

FP8_SPEC = dataclasses.replace(
    REFERENCE_SPEC, name="reference-fp8", dtypes=frozenset(FP8_DTYPES), descales=True
)
# The fixed constants (max_offset + threshold <= log2 fp8 max) the bound must hold for.
FIXED_CHAINS = {
    "float8_e4m3fn": [(8.0, 0.0), (4.0, 4.0), (0.0, 8.0)],
    "float8_e5m2": [(8.0, 0.0), (8.0, 4.0), (8.0, 7.0)],
}
DESCALE = np.full((1, 1), 0.375, np.float32)


def _fp8(shape: tuple[int, ...], dtype: str = "float8_e4m3fn", seed: int = 0) -> np.ndarray:
    return round_to(np.random.default_rng(seed).normal(size=shape) * 2, dtype).astype(
        getattr(ml_dtypes, dtype)
    )


def _case(**fields) -> AttentionCase:
    q, k, v = (_fp8((1, 5, 1, 4), seed=s) for s in range(3))
    return AttentionCase(q, k, v, **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"q_descale": np.ones((1, 2), np.float32)}, r"q_descale must have shape \[B, Hkv\]"),
        ({"k_descale": np.ones((1, 1))}, "k_descale must be a float32 numpy array"),
        ({"v_descale": np.zeros((1, 1), np.float32)}, "v_descale=.* must be finite and > 0"),
        ({"v_descale": np.full((1, 1), np.inf, np.float32)}, "must be finite and > 0"),
        ({"output_dtype": "float8_e5m2"}, "FP8 outputs are not allowed"),
    ],
)
def test_bad_quantization_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        _case(**fields)


def test_descales_need_fp8_inputs():
    x = np.ones((1, 2, 1, 4), np.float16)
    with pytest.raises(ValueError, match="q_descale is allowed only with FP8 inputs"):
        AttentionCase(x, x, x, q_descale=DESCALE)


def test_output_dtype_defaults_to_bf16_for_fp8_and_the_input_otherwise():
    assert _case().out_dtype == "bfloat16"
    assert _case(output_dtype="float16").out_dtype == "float16"
    x = np.ones((1, 2, 1, 4), np.float16)
    assert AttentionCase(x, x, x).out_dtype == "float16"


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_saved_fp8_case_round_trips_with_its_descales(tmp_path, dtype):
    q, k, v = (_fp8((2, 3, 2, 4), dtype, seed) for seed in range(3))
    descales = {f"{n}_descale": np.full((2, 2), 0.5 + i, np.float32) for i, n in enumerate("qkv")}
    case = AttentionCase(q, k, v, output_dtype="float32", **descales)
    loaded = AttentionCase.load(case.save(tmp_path / "case.npz"))
    assert loaded.dtype == dtype and loaded.output_dtype == "float32"
    assert all(np.array_equal(getattr(loaded, n).view(np.uint8), getattr(case, n).view(np.uint8))
               for n in "qkv")  # fmt: skip
    for name in descales:
        assert np.array_equal(getattr(loaded, name), descales[name])


@settings(max_examples=15, deadline=None)
@given(attention_cases(spec=FP8_SPEC, max_len=12, max_heads=2, features=()))
def test_exact_tier_matches_naive_mpmath_on_dequantized_values(case):
    rows = np.zeros((case.B, case.Hq, case.Sq), bool)
    rows[:, :, :2] = True
    exact, naive = exact_attention(case, rows), naive_exact_attention(case, rows)
    evaluated = ~np.isnan(naive.o)
    # within the exact tier's certified bound (it drops weights below 2^-(F+2)) and the naive
    # loop's final rounding to double
    o_bound = np.moveaxis(exact.o_err_bound, 2, 1)[..., None] + 2**-52 * np.abs(naive.o)
    assert (np.abs(exact.o - naive.o)[evaluated] <= o_bound[evaluated]).all()
    finite = np.isfinite(naive.lse)  # empty rows: -inf on both sides
    assert np.array_equal(np.isneginf(exact.lse), np.isneginf(naive.lse))
    lse_error = np.abs(exact.lse[finite] - naive.lse[finite])
    assert (lse_error <= exact.lse_err_bound[finite] + 2**-52 * np.abs(naive.lse[finite])).all()


def float64_disagreement(case: AttentionCase) -> tuple[float, float]:
    """How far two correct float64 evaluations of ``case`` may differ: the rowwise reference
    folds the descales into the score scale (``(scale q_d k_d) (q . k)``), the streaming tier
    multiplies them into q and k first, so each score may differ by a few float64 roundings of
    ``sum |q_i k_i|`` (dequantized, times the scale): ``(D + 4) 2^-52`` of that, in natural-log
    units after the exp2 folding. A score difference ``e`` moves every weight by a factor
    within ``e^(+-e)``, so O by about ``2 e max |v|`` and the LSE by ``e``. Returns ``(e, max
    |v|)``; with scores near 5e4 (amax descales of 64 on K) ``e`` reaches 1e-11."""

    def largest(name: str, b: int, h: int) -> float:  # padding's NaN or inf: never read
        x = np.abs(getattr(case, name)[b, :, h].astype(np.float64))
        return float(np.max(x, where=np.isfinite(x), initial=0.0))

    score_max = v_max = 0.0
    for b, h in np.ndindex(case.B, case.Hq):
        g = case.kv_head(h)
        q, k = (
            largest("q", b, h) * case.descale("q", b, g),
            largest("k", b, g) * case.descale("k", b, g),
        )
        score_max = max(score_max, case.softmax_scale * case.D * q * k)
        v_max = max(v_max, largest("v", b, g) * case.descale("v", b, g))
    return (case.D + 4) * 2.0**-52 * score_max, v_max


@pytest.mark.parametrize(
    "backend",
    [
        "numpy",
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("torch") is None, reason="torch is not installed"
            ),
        ),
    ],
)
def test_rowwise_float64_reads_dequantized_values(backend):
    """The float64 reference of long cases (reference.rowwise) dequantizes as the streaming
    tier does, on NumPy and on torch (the GPU's path; torch on the CPU here): it once read the
    raw FP8 values and passed FP8 arrays to torch, which refuses them."""

    @settings(max_examples=15, deadline=None)
    @given(attention_cases(spec=FP8_SPEC, max_len=40, max_heads=4, features=("varlen_batch",)))
    def check(case):
        expected = streaming_attention(case, StreamingPrecision.float64())
        got = rowwise_attention(case, backend=backend, device="cpu")
        score_error, v_max = float64_disagreement(case)
        o_tol = 4 * score_error * v_max + 1e-12
        assert np.allclose(got.o, expected.o, rtol=1e-12, atol=o_tol, equal_nan=True)
        assert np.allclose(
            got.lse, expected.lse, rtol=1e-12, atol=2 * score_error + 1e-12, equal_nan=True
        )

    check()


@settings(max_examples=40, deadline=None)
@given(
    attention_cases(
        spec=FP8_SPEC, max_len=5 * FP8_SPEC.tile_n + 1, features=("hidden", "varlen_batch")
    ),
    st.data(),
)
def test_fixed_fp8_chain_stays_within_its_bound_of_exact(case, data):
    """Every correct FP8 chain with the fixed constants, on the default strategies (descales
    honest and adversarial, the creeping ramp): the emulation is within the bound of the exact
    value, O and LSE; no row is marked saturating (its bound may still be inf where fp32 scores
    of ~1e6 leave no finite bound, as for 16-bit inputs)."""
    offset, threshold = data.draw(st.sampled_from(FIXED_CHAINS[case.dtype]))
    rounded = data.draw(st.booleans())
    precision = StreamingPrecision.fp8_attention(
        case.dtype,
        max_offset_log2=offset,
        rescale_threshold_log2=threshold,
        row_sum_from_rounded_p=rounded,
    )
    block_n = data.draw(st.sampled_from([4, FP8_SPEC.tile_n]))
    exact = exact_attention(case).as_result()
    result = streaming_attention(case, precision, block_n=block_n)
    bound = error_bound(case, exact, precision, block_n=block_n)
    lse_bound = lse_error_bound(case, exact, precision, block_n=block_n)
    assert (
        not precision.can_saturate and not saturating_rows(case, precision, block_n=block_n).any()
    )
    assert_within_bound(result, exact, bound, output_dtype=case.out_dtype, lse_bound=lse_bound)


def _creeping_case(seed: int, dtype: str = "float8_e4m3fn", Sk: int = 160) -> AttentionCase:
    shape = Shape(1, 4, Sk, 1, 1, 16, 16)
    rng = np.random.default_rng(seed)
    arrays = creeping_max(rng, shape, 0.25, block_n=16)
    (q, qd), (k, kd), (v, vd) = (quantize(a, dtype, "amax", 1) for a in arrays)
    return AttentionCase(q, k, v, 0.25, q_descale=qd, k_descale=kd, v_descale=vd)


FA4 = StreamingPrecision.fp8_attention(
    "float8_e4m3fn", max_offset_log2=8.0, rescale_threshold_log2=4.0
)


@pytest.mark.parametrize("seed", range(4))
def test_creeping_max_makes_fa4_skip_rescales_and_clamp_p(seed):
    """The strategy's trigger, proven by the trace: under FA4's constants every row skips
    rescales and has P clamped; the fixed constants (4 and 4) never clamp on it."""
    case = _creeping_case(seed)
    trace = RescaleTrace()
    streaming_attention(case, FA4, block_n=16, trace=trace)
    assert (trace.skipped_rescales >= 2).all() and (trace.clamped_p >= 1).all()
    streaming_attention(case, cpu_fp8.FIXED["float8_e4m3fn"], block_n=16, trace=trace)
    assert (trace.skipped_rescales >= 2).all() and (trace.clamped_p == 0).all()


def test_strategies_draw_the_creeping_ramp_for_fp8():
    """The default strategies build the creeping ramp for FP8 ``ramp`` draws, and it clamps P
    under FA4's constants."""
    cases = attention_cases(
        spec=FP8_SPEC,
        distributions=("ramp",),
        dtypes=("float8_e4m3fn",),
        max_len=12 * FP8_SPEC.tile_n,
        features=(),
    )
    clamped = []  # per case with a row of three visible blocks or more: P clamped?

    @settings(max_examples=40, deadline=None, database=None)
    @given(cases)
    def collect(case):
        trace = RescaleTrace()
        streaming_attention(case, FA4, block_n=FP8_SPEC.tile_n, trace=trace)
        if trace.visible_blocks.max() >= 3:
            clamped.append(bool(trace.clamped_p.any() and trace.skipped_rescales.any()))

    collect()
    # masks, tiny head dims and clipping descales blunt some (69 % clamped over 4 seeds)
    assert len(clamped) >= 5 and sum(clamped) >= 0.5 * len(clamped), clamped


def test_saturating_chain_has_an_undefined_bound_where_p_can_clamp():
    case = _creeping_case(0)
    exact = exact_attention(case).as_result()
    rows = saturating_rows(case, FA4, block_n=16)
    assert rows.all()  # every row sees two blocks or more
    assert np.isinf(error_bound(case, exact, FA4, block_n=16)).all()
    one_block = saturating_rows(_creeping_case(0, Sk=16), FA4, block_n=16)
    assert not one_block.any()  # a row's first block sets its max: P <= 2^8 < 448
    assert not saturating_rows(case, cpu_fp8.FIXED["float8_e4m3fn"], block_n=16).any()


def test_declared_saturating_chain_is_a_finding():
    case = _creeping_case(0)
    spec = dataclasses.replace(cpu_fp8.fp8_fixed().spec, precision={"float8_e4m3fn": FA4})
    result = streaming_attention(case, FA4, block_n=16)
    findings = reference_findings(case, result, spec, hint=False)
    assert any("the declared chain can saturate" in f.message for f in findings)


def _v_descale_case() -> AttentionCase:
    """Tiny v descale (a V whose quantizer clipped it): folded into P, P sinks into e4m3's
    subnormals."""
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(1, n, h, 16)) for n, h in ((16, 2), (64, 1), (64, 1))]
    kinds = ("amax", "amax", "clipping")
    (q, qd), (k, kd), (v, vd) = (
        quantize(a, "float8_e4m3fn", kind, 1) for a, kind in zip(arrays, kinds, strict=True)
    )
    return AttentionCase(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)


TRIGGERS = {
    "fa4_saturation": lambda: _creeping_case(0),
    "forgets_k_descale": lambda: _creeping_case(1),
    "v_descale_in_p": _v_descale_case,
}


@pytest.mark.parametrize("mistake", sorted(TRIGGERS))
def test_fp8_mutant_is_caught_on_its_trigger_and_the_fixed_kernel_passes(mistake):
    case = TRIGGERS[mistake]()
    broken, fixed = cpu_fp8.Fp8Adapter(mistake), cpu_fp8.fp8_fixed()
    caught = reference_findings(case, broken(case), broken.spec, hint=False)
    assert any(f.check in ("bound", "lse") for f in caught), mistake
    assert reference_findings(case, fixed(case), fixed.spec, hint=False) == []


def test_report_config_builds_fp8_cases_and_refuses_fp8_fields_elsewhere():
    config = Config("float8_e4m3fn", 16, 8, 40, Hq=2, distribution="ramp", descales="amax")
    case = config.build()
    assert case.dtype == "float8_e4m3fn" and case.k_descale is not None
    assert config.fields()["descales"] == "amax" and "output_dtype" not in config.fields()
    assert "descales" not in Config("bfloat16", 16, 8, 40).fields()  # old digests unchanged
    with pytest.raises(ValueError, match="config.descales='amax' is allowed only with FP8"):
        Config("bfloat16", 16, 8, 40, descales="amax")
    with pytest.raises(ValueError, match="config.output_dtype='float8_e5m2' must be None or"):
        Config("float8_e5m2", 16, 8, 40, output_dtype="float8_e5m2")
    assert {c.dtype for c in preset("fp8")} == set(FP8_DTYPES)
