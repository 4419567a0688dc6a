"""The forward-surface features that ``attention_cases`` draws for a kernel that declares them.

The kernel suite's feature sweep (``test_kernels.test_kernel_feature_passes_every_check``)
runs each declared feature on every run, ci profile included. These tests prove what that
reaches: for ``streaming-fa`` (the kernel the CPU run checks) the sweep lists every feature, and
each feature's strategy gives cases that have it, from the simplest one on: a single query over
4096 keys with GQA, varlen batches of 3+ sequences with D <= 64, softcap, sinks, keys hidden
behind masks. The free strategy draws each feature too, and the three deliberately broken
call-option kernels are found by a Hypothesis search over their feature's cases.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.properties import coverage
from attention_crossval.properties.strategies import (
    FEATURES,
    attention_cases,
    case_features,
    spec_features,
)

pytestmark = pytest.mark.cpu

SPEC = StreamingAdapter().spec
QUIET = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _claims(feature: str, case) -> None:
    """The issue's "Done when" claims, per feature, on one case."""
    assert feature in case_features(case), case.describe()
    if feature == "long_decode":
        assert case.Sq <= 2 and case.Sk >= 4096 and case.Hq > case.Hkv, case.describe()
    if feature == "varlen_batch":
        assert case.B >= 3 and case.D <= 64, case.describe()


def test_streaming_fa_declares_every_feature() -> None:
    assert coverage.feature_sweep(SPEC) == list(FEATURES)
    plain = KernelSpec(name="plain", mask_kinds=("causal",), max_seqlen=1024)
    assert spec_features(plain) == ()


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_strategy_has_its_feature_from_the_simplest_case(feature: str) -> None:
    strategy = attention_cases(spec=SPEC, max_len=2 * SPEC.tile_n + 1, required_features=[feature])
    _claims(feature, find(strategy, lambda case: True, settings=settings(**QUIET)))
    if feature == "long_decode":  # the simplest: one query over 4096 keys, GQA
        simplest = find(strategy, lambda case: True, settings=settings(**QUIET))
        assert (simplest.Sq, simplest.Sk) == (1, 4096) and simplest.Hq > simplest.Hkv

    @settings(max_examples=5, phases=[Phase.generate], **QUIET)
    @given(strategy)
    def drawn(case) -> None:
        _claims(feature, case)

    drawn()


def test_the_free_strategy_draws_every_feature() -> None:
    """Counted over 300 derandomized draws of the default strategy for streaming-fa."""
    counts: Counter[str] = Counter()

    @settings(max_examples=300, derandomize=True, phases=[Phase.generate], **QUIET)
    @given(attention_cases(spec=SPEC, max_len=2 * SPEC.tile_n + 1))
    def draw(case) -> None:
        counts.update(coverage.features_of(case))

    draw()
    assert set(counts) == set(FEATURES), counts


def test_backward_cases_draw_no_forward_surface_feature() -> None:
    from attention_crossval.properties.strategies import backward_cases

    @settings(max_examples=20, **QUIET)
    @given(backward_cases(spec=SPEC))
    def draw(case) -> None:
        assert not case_features(case.forward) - {"hidden"}, case.forward.describe()

    draw()


@pytest.mark.parametrize(
    ("name", "feature"),
    [
        ("page_lookup_off_by_one", "paged"),
        ("empty_split_lse_zero", "splits"),
        ("packed_offset_overrun", "packed"),
    ],
)
def test_feature_cases_find_the_broken_call_option_kernel(name: str, feature: str) -> None:
    """The feature's strategy, searched as the kernel suite does (in a worker), finds the bug."""
    worker = IsolatedKernel(f"attention_crossval.testing.broken.cpu_call_options:{name}")
    strategy = attention_cases(spec=SPEC, max_len=2 * SPEC.tile_n + 1, required_features=[feature])
    try:
        found = find(
            strategy,
            lambda case: bool(run_case(worker, case).findings),
            settings=settings(max_examples=60, derandomize=True, phases=[Phase.generate], **QUIET),
        )
    finally:
        worker.close()
    assert feature in case_features(found)


def test_bad_feature_names_raise_value_error() -> None:
    with pytest.raises(ValueError, match=r"features=\['pagedd'\] must be names from"):
        attention_cases(spec=SPEC, features=["pagedd"])
    plain = KernelSpec(name="plain", device="cpu")
    with pytest.raises(ValueError, match=r"required_features=\['paged'\] are not declared"):
        attention_cases(spec=plain, required_features=["paged"])
    with pytest.raises(ValueError, match="at most one of"):
        attention_cases(spec=SPEC, required_features=["long_decode", "varlen_batch"])
    with pytest.raises(ValueError, match="need the default dtypes"):
        attention_cases(spec=SPEC, dtypes=["float16"], required_features=["long_decode"])
