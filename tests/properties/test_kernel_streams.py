"""The kernel tests' cases (properties/test_kernels.py): each test draws its own, and the sweeps
reach what the free test reaches (varlen batches of 3+, long decode, lengths past 4 K blocks).

Drawn here without a kernel: the strategies and seeds the tests use, for ``streaming-fa``'s
declaration, under a fixed run seed."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties.kernel_suite import (
    FREE,
    GPU_FREE_PARTS,
    SWEEP_BLOCKS,
    SWEEP_EXAMPLES,
    feature_examples,
    feature_strategy,
    free_parts,
    free_property,
    max_len_for,
    stream_name,
    sweep_strategy,
)
from attention_crossval.properties.strategies import attention_cases, case_features, drawn_examples
from attention_crossval.pytest_plugin import derived_seed
from attention_crossval.reference.case import AttentionCase

pytestmark = pytest.mark.cpu

RUN_SEED = 20261202
KERNEL = "streaming-fa"
SPEC = resolve(KERNEL).spec
_SLOW = [HealthCheck.too_slow]  # a long decode of 4096 keys


def drawn(strategy: st.SearchStrategy[AttentionCase], stream: str, count: int) -> list[str]:
    """The descriptions of the first ``count`` cases ``strategy`` draws under the seed of
    ``stream`` (generation only, as the kernel tests run: no example database)."""
    seed = derived_seed(RUN_SEED, stream_name(KERNEL, stream))
    return [f"{c.label} | {c.describe()}" for c in drawn_examples(strategy, count, seed=seed)]


def test_other_runs_of_the_free_property_draw_other_cases() -> None:
    """own-sm90's free test (tests/kernel/test_own_kernels.py) runs the free property again: under
    the kernel's own seed it drew exactly the free test's cases; its stream draws others (after
    Hypothesis' simplest, the same in every stream)."""
    free_cases = attention_cases(spec=SPEC, max_len=max_len_for(SPEC))
    free = drawn(free_cases, FREE, 8)
    assert drawn(free_cases, FREE, 8) == free  # the same stream draws the same cases
    assert not set(drawn(free_cases, "own-kernels", 8)[1:]) & set(free[1:])


def test_a_gpu_kernels_free_test_runs_in_parts_that_draw_other_cases() -> None:
    """A GPU kernel's free property runs as GPU_FREE_PARTS tests (a CPU kernel's as one); part
    0 draws the free test's own cases, every other part a stream of its own."""
    assert free_parts(SPEC) == 1
    assert free_parts(dataclasses.replace(SPEC, device="cuda")) == GPU_FREE_PARTS > 1
    free_cases = attention_cases(spec=SPEC, max_len=max_len_for(SPEC))
    parts = [drawn(free_cases, FREE if i == 0 else f"{FREE}:part{i}", 8) for i in range(3)]
    for i in range(3):
        for j in range(i):
            assert not set(parts[i][1:]) & set(parts[j][1:]), (i, j)
    with pytest.raises(ValueError, match="part=4 must lie in"):
        free_property(KERNEL, None, part=4, parts=4)


@pytest.mark.parametrize(
    ("stream", "strategy", "count"),
    [
        ("sweep:ramp:causal", sweep_strategy(SPEC, "ramp", "causal"), SWEEP_EXAMPLES),
        ("sweep:gaussian:varlen", sweep_strategy(SPEC, "gaussian", "varlen"), SWEEP_EXAMPLES),
        ("feature:paged", feature_strategy(SPEC, "paged"), feature_examples("paged")),
    ],
    ids=["sweep-ramp-causal", "sweep-gaussian-varlen", "feature-paged"],
)
def test_sweeps_draw_other_cases_than_the_free_test(
    stream: str, strategy: st.SearchStrategy[AttentionCase], count: int
) -> None:
    """A sweep's drawn cases (after Hypothesis' simplest, the same in every stream) differ from
    those the same strategy draws under the free test's seed."""
    own, under_free_seed = drawn(strategy, stream, count), drawn(strategy, FREE, count)
    assert len(own) == count
    assert not set(own[1:]) & set(under_free_seed[1:])


@pytest.mark.parametrize(
    ("feature", "mask_kind"),
    [("varlen_batch", "varlen"), ("varlen_batch", "causal"), ("long_decode", "causal")],
)
def test_sweeps_keep_the_base_features(feature: str, mask_kind: str) -> None:
    """A (distribution, mask kind) sweep pair's strategy may still draw varlen batches of 3+ and
    long decodes, with the pair's distribution and mask kind (before: its ``distributions``
    turned them off, and requiring one was refused)."""
    strategy = attention_cases(
        spec=SPEC,
        max_len=max_len_for(SPEC, SWEEP_BLOCKS),
        distributions=["near_ties"],
        required_mask_kinds=[mask_kind],
        required_features=[feature],
    )

    @settings(max_examples=2, database=None, deadline=None, suppress_health_check=_SLOW)
    @given(strategy)
    def check(case: AttentionCase) -> None:
        assert feature in case_features(case)
        assert "dist=near_ties" in case.label and mask_kind in case.mask.kinds

    check()


def test_sweep_lengths_reach_eight_blocks() -> None:
    """Sweep lengths go to :data:`SWEEP_BLOCKS` K blocks and one key (before: 2 for a CPU
    kernel, 4 for a GPU one)."""
    longest = SWEEP_BLOCKS * SPEC.tile_n + 1
    strategy = sweep_strategy(SPEC, "gaussian", "causal").filter(
        lambda case: case.Sk > 4 * SPEC.tile_n + 1 and "long_decode" not in case_features(case)
    )

    @settings(
        max_examples=1,
        database=None,
        deadline=None,
        suppress_health_check=[*_SLOW, HealthCheck.filter_too_much],
    )
    @given(strategy)
    def check(case: AttentionCase) -> None:
        assert case.Sk <= longest

    check()
