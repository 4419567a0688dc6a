"""Kernel-API validation: a kernel declaring ``KernelSpec.validates_lengths`` refuses lengths
that disagree with its tensors, rather than reading past them or answering silently.

The framework's own constructors refuse such lengths, so this property goes around them: it
draws a valid case inside the kernel's declaration, then sets one length past its tensor's
padded length (by at most the guard band), one negative, or one entry too many, in the padded
or (where declared) packed layout, on a copy of the case whose q, k and v are views into
buffers with a NaN guard band past each sequence's end. The kernel must raise; a kernel that
answers fails, as having read past its tensors when the guard's NaN reached its output, as a
silent answer otherwise. A crash or hang of an isolated kernel is not a refusal.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.length_checks import check_lengths
from attention_crossval.kernel.contract.spec import KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.execution import KernelCrashed
from attention_crossval.properties.kernels_under_test import (
    chosen_kernels,
    kernel_adapter,
    kernel_param,
    kernel_spec,
)
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.testing.broken.cpu_lengths import LaxLengthsAdapter

GUARD = 64  # NaN rows past each sequence's end: the most a bad length reaches past the tensor
CORRUPTIONS = ("past", "negative", "count")
MAX_EXAMPLES = 25  # each refused case costs its drawing only: the profile's count if lower
_QUIET = settings(database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel" in metafunc.fixturenames:
        kernels = [k for k in chosen_kernels(metafunc.config) if kernel_spec(k).validates_lengths]
        metafunc.parametrize("kernel", [kernel_param(k, id=k) for k in kernels])


def guarded(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` ``[B, S, H, X]`` inside a buffer with :data:`GUARD` NaN
    rows after each batch's S rows."""
    B, S, H, X = array.shape
    buffer = np.full((B, S + GUARD, H, X), np.nan, dtype=array.dtype)
    buffer[:, :S] = array
    view = buffer[:, :S]
    view.setflags(write=False)
    return view


def disagreeing(case: AttentionCase, corruption: str, which: str, b: int, by: int, layout: str):
    """``case`` with ``mask.<which>`` corrupted (module docstring; ``by`` >= 1 is how far past
    or below), ``layout`` set and q, k, v :func:`guarded`, built around the constructors."""
    limit = case.Sq if which == "q_lengths" else case.Sk
    lengths = list(getattr(case.mask, which) or (limit,) * case.B)
    if corruption == "past":
        lengths[b] = limit + by
    elif corruption == "negative":
        lengths[b] = -by
    else:
        lengths.append(lengths[b])
    mask = copy.copy(case.mask)
    object.__setattr__(mask, which, tuple(lengths))
    bad = copy.copy(case)
    for name, value in (("mask", mask), ("layout", layout), ("page_size", None)):
        object.__setattr__(bad, name, value)
    for name in ("q", "k", "v"):
        object.__setattr__(bad, name, guarded(getattr(case, name)))
    object.__setattr__(bad, "label", f"{case.label} lengths={corruption}:{which}[{b}]")
    return bad


@st.composite
def disagreeing_cases(draw: st.DrawFn, spec: KernelSpec) -> AttentionCase:
    """A valid varlen case inside ``spec``, corrupted by :func:`disagreeing`."""
    case = draw(
        attention_cases(
            spec=spec,
            max_len=min(spec.tile_n + 1, spec.max_seqlen),
            max_batch=3,
            required_mask_kinds=["varlen"],
            features=(),
        )
    )
    layout = draw(st.sampled_from(sorted(spec.layouts)))
    return disagreeing(
        case,
        draw(st.sampled_from(CORRUPTIONS)),
        draw(st.sampled_from(["q_lengths", "k_lengths"])),
        draw(st.integers(0, case.B - 1)),
        draw(st.integers(1, GUARD)),
        layout,
    )


def assert_refused(adapter: KernelAdapter, case: AttentionCase) -> None:
    """AssertionError unless ``adapter(case)`` raises (a crash or hang of an isolated kernel is
    no refusal); the message says whether the NaN guard reached the output."""
    __tracebackhide__ = True
    try:
        result = adapter(case)
    except KernelCrashed as error:
        if error.check != "error":
            message = f"{case.label}: {error.check} instead of a refusal: {error}"
            raise AssertionError(message) from None
        return
    except Exception:  # noqa: BLE001 - any exception the kernel raises is its refusal
        return
    outputs = [result.o] + ([] if result.lse is None else [result.lse])
    if any(np.isnan(np.asarray(x, dtype=np.float64)).any() for x in outputs):
        raise AssertionError(
            f"{case.label}: read past its tensors (the NaN guard band reached its output)"
        )
    raise AssertionError(f"{case.label}: a silent answer to lengths that disagree with its tensors")


def test_kernel_refuses_lengths_that_disagree_with_its_tensors(kernel: str) -> None:
    adapter = kernel_adapter(kernel)

    @settings(_QUIET, max_examples=min(settings.default.max_examples, MAX_EXAMPLES))
    @given(disagreeing_cases(adapter.spec))
    def check(case: AttentionCase) -> None:
        assert_refused(adapter, case)

    check()


def _lax_case(corruption: str) -> AttentionCase:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 20, 2, 16)).astype(np.float16) for _ in range(3))
    case = AttentionCase(q, k, v, mask=Mask(q_lengths=(20, 9), k_lengths=(20, 13)))
    return disagreeing(case, corruption, "k_lengths", 0, 5, "padded")


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("corruption", "message"),
    [
        ("past", "read past its tensors"),
        ("negative", "a silent answer"),
        ("count", "a silent answer"),
    ],
)
def test_lax_kernel_is_caught(corruption: str, message: str) -> None:
    """The lax kernel reads past its tensors or answers silently; the check says which."""
    with pytest.raises(AssertionError, match=message):
        assert_refused(LaxLengthsAdapter(), _lax_case(corruption))


@pytest.mark.cpu
def test_the_property_catches_the_lax_kernel() -> None:
    """The drawn property (generation only, a few cases) fails on the lax kernel, whose valid
    answers match the float64 tier: the check reacts to the lengths, nothing else."""
    adapter = LaxLengthsAdapter()

    @settings(_QUIET, max_examples=5, phases=[Phase.generate])
    @given(disagreeing_cases(adapter.spec))
    def check(case: AttentionCase) -> None:
        assert_refused(adapter, case)

    with pytest.raises(AssertionError):
        check()
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 20, 2, 16)).astype(np.float16) for _ in range(3))
    clean = AttentionCase(q, k, v, mask=Mask(q_lengths=(20, 9), k_lengths=(20, 13)))
    expected = streaming_attention(clean, StreamingPrecision.float64())
    np.testing.assert_allclose(adapter(clean).o, expected.o, atol=1e-12)


@pytest.mark.cpu
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_check_lengths_names_the_field_and_rule(corruption: str) -> None:
    bad = _lax_case(corruption)
    rule = "must have B=2 entries" if corruption == "count" else r"must be ints in \[0, 20\]"
    with pytest.raises(ValueError, match=rf"mask.k_lengths.*{rule}"):
        check_lengths(bad)
