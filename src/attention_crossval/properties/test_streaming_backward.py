"""reference/streaming_backward.py: the streaming backward against the exact tier, the
softmax identities on its trace, zero gradient where nothing is seen, determinism; and the dO
distributions' claims. The property bodies live in :mod:`properties.backward_properties`
(shared with the mutation hunt); each test here runs one on the production tier.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from attention_crossval.properties.backward_properties import (
    BLOCKS,
    FLOAT64,
    PROPERTIES,
    gqa_case,
)
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import (
    GRADIENT_DISTRIBUTIONS,
    REFERENCE_SPEC,
    backward_cases,
    build_do,
)
from attention_crossval.reference import streaming_backward as tier
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.precision import BackwardPrecision, StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.reference.streaming_backward import streaming_backward

pytestmark = pytest.mark.cpu


def _run(name: str, args: tuple) -> None:
    """Property ``name`` on the production tier; a failure saves the forward case."""
    with reproducer_on_failure(args[0].forward):
        PROPERTIES[name].check(tier, *args)


@given(PROPERTIES["float64_matches_exact"].strategy)
def test_float64_streaming_matches_exact(args: tuple) -> None:
    """float64 mode equals the certified exact gradient to ~1e-12 (every element)."""
    _run("float64_matches_exact", args)


@given(PROPERTIES["emulated_within_bound"].strategy)
def test_emulated_precision_within_the_derived_bound(args: tuple) -> None:
    """FlashAttention's bf16/fp16/fp32 chain stays within its derived per-element bound."""
    _run("emulated_within_bound", args)


@given(PROPERTIES["ds_rows_sum_to_dlse"].strategy)
def test_ds_rows_sum_to_dlse(args: tuple) -> None:
    """sum_j dS_ij = dlse_i (0 without an LSE gradient) on every row: the D term."""
    _run("ds_rows_sum_to_dlse", args)


@given(PROPERTIES["p_rows_sum_to_one"].strategy)
def test_recomputed_p_rows_sum_to_one(args: tuple) -> None:
    """P recomputed from the saved LSE sums to 1 on every non-empty row."""
    _run("p_rows_sum_to_one", args)


@given(PROPERTIES["zero_gradient_where_unseen"].strategy)
def test_empty_rows_and_padding_have_zero_gradient(args: tuple) -> None:
    """Empty and padded rows, and keys nothing sees, get exactly zero gradient."""
    _run("zero_gradient_where_unseen", args)


@given(PROPERTIES["deterministic_across_seeds"].strategy)
@example((gqa_case(), 1))
def test_deterministic_mode_is_bitwise_repeatable_across_seeds(args: tuple) -> None:
    """dq_order='fixed' gives bitwise equal gradients for any seed."""
    _run("deterministic_across_seeds", args)


def test_permuted_dq_order_changes_bits_and_nothing_else() -> None:
    """The control for the property above: on a case with several K blocks, the atomic-add
    order changes dq's bits (so an order change is visible) but never dk or dv."""
    case = gqa_case()
    precision = dataclasses.replace(
        BackwardPrecision.flash_attention("bfloat16", deterministic=False), output_dtype=None
    )
    first = streaming_backward(case, precision, **BLOCKS, seed=0)
    other = streaming_backward(case, precision, **BLOCKS, seed=1)
    assert (first.dq != other.dq).any()
    np.testing.assert_array_equal(first.dk, other.dk)
    np.testing.assert_array_equal(first.dv, other.dv)
    np.testing.assert_allclose(first.dq, other.dq, rtol=1e-5, atol=1e-6)


def test_flushed_ds_reaches_neither_dq_nor_dk() -> None:
    """``ds_flushes_subnormals``: with dO of 2^-20 every fp16 dS is below fp16's smallest
    normal (2^-14), so the flushing chain's dq and dk are exactly 0 where the same chain
    without the flush has nonzero values (its subnormal dS); dv does not read dS and is
    bitwise the same."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 24, 2, 16)).astype(np.float16) for _ in range(3))
    do = (rng.standard_normal((1, 24, 2, 16)) * 2.0**-20).astype(np.float16)
    case = BackwardCase(AttentionCase(q, k, v), do)
    keeps = dataclasses.replace(BackwardPrecision.flash_attention("float16"), output_dtype=None)
    flushes = dataclasses.replace(keeps, ds_flushes_subnormals=True)
    kept, flushed = (streaming_backward(case, p, **BLOCKS) for p in (keeps, flushes))
    assert np.count_nonzero(kept.dq) > 0 and np.count_nonzero(kept.dk) > 0
    assert np.count_nonzero(flushed.dq) == np.count_nonzero(flushed.dk) == 0
    np.testing.assert_array_equal(flushed.dv, kept.dv)


def test_given_forward_is_used_and_checked() -> None:
    """``forward=`` replaces the internal forward run (same O/LSE: same gradients), and a
    forward of the wrong shape or without LSE is a ValueError naming the field."""
    case = gqa_case()
    forward = streaming_attention(case.forward, StreamingPrecision.float64(), **BLOCKS)
    given_fwd = streaming_backward(case, FLOAT64, **BLOCKS, forward=forward)
    internal = streaming_backward(case, FLOAT64, **BLOCKS)
    np.testing.assert_array_equal(given_fwd.dq, internal.dq)
    with pytest.raises(ValueError, match="forward.lse must be given"):
        streaming_backward(case, FLOAT64, forward=AttentionResult(o=forward.o, lse=None))
    with pytest.raises(ValueError, match=r"forward.o shape .* must be \[B, Sq, Hq, Dv\]"):
        streaming_backward(case, FLOAT64, forward=AttentionResult(o=forward.o[:1], lse=forward.lse))


@pytest.mark.parametrize("name", list(GRADIENT_DISTRIBUTIONS))
def test_gradient_distribution_claims_hold(name: str) -> None:
    """Each dO distribution's claim holds on every drawn case and applies to at least one
    (half the cases have at most tile_n keys, where ``orthogonal``'s k_length < Dv applies)."""
    dist = GRADIENT_DISTRIBUTIONS[name]
    applicable = []
    short = backward_cases(do_distributions=[name], max_len=REFERENCE_SPEC.tile_n)

    @given(st.one_of(backward_cases(do_distributions=[name]), short))
    def check(case) -> None:
        evidence = dist.claim(case)
        assert evidence.failure is None, evidence.failure
        applicable.append(evidence.applicable)

    check()
    if name != "gaussian":  # the baseline claims nothing
        assert max(applicable) > 0, f"{name}: claim never applied to a generated case"


def _short_keys_case() -> AttentionCase:
    """Sk=3 keys < Dv=8, so dO can be exactly orthogonal to V; bf16."""
    rng = np.random.default_rng(3)
    dt = np.dtype("bfloat16")
    q, k, v = (
        rng.standard_normal(s).astype(dt) for s in ((1, 5, 2, 4), (1, 3, 1, 4), (1, 3, 1, 8))
    )
    return AttentionCase(q, k, v)


@pytest.mark.parametrize("name", [n for n in GRADIENT_DISTRIBUTIONS if n != "gaussian"])
def test_gradient_claims_reject_a_gaussian_do(name: str) -> None:
    """The controls: each claim applies to its own dO on a fixed case and fails for a
    gaussian dO on the same case (a claim that cannot fail proves nothing)."""
    case, dist = _short_keys_case(), GRADIENT_DISTRIBUTIONS[name]
    own = dist.claim(build_do(dist, case, seed=0))
    assert own.failure is None and own.applicable > 0
    gaussian = build_do(GRADIENT_DISTRIBUTIONS["gaussian"], case, seed=0)
    assert dist.claim(gaussian).failure is not None


def test_backward_cases_rejects_unknown_distributions() -> None:
    with pytest.raises(ValueError, match="names=\\['uniform'\\] must be a non-empty subset"):
        backward_cases(do_distributions=["uniform"])


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
        streaming_backward(gqa_case(), **kwargs)
    with pytest.raises(ValueError, match="case must be a BackwardCase"):
        streaming_backward(gqa_case().forward)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": "float64"}, "forward must be a StreamingPrecision"),
        ({"p_dtype": "float32"}, "p_dtype='float32' must be None, 'float16' or 'bfloat16'"),
        ({"ds_dtype": "int8"}, "ds_dtype='int8' must be None"),
        ({"accum_dtype": "float16"}, "accum_dtype='float16' must be 'float32' or 'float64'"),
        ({"dq_order": "atomic"}, r"dq_order='atomic' must be one of \['fixed', 'permuted'\]"),
        ({"ds_flushes_subnormals": 1}, "ds_flushes_subnormals=1 must be a bool"),
        ({"ds_flushes_subnormals": True}, "ds_flushes_subnormals=True needs a ds_dtype"),
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
