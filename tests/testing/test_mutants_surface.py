"""testing/mutants_surface.py: the float64 agreement property, run on softcap and sink cases,
catches each broken streaming tier; the unmutated tier passes the same property. The split-KV
and paged mutants, inside the CPU ``streaming-fa`` kernel, fail the kernel suite's checks on
their trigger cases and are found by its property on the default strategy (the 10-seed sweep
under the ci profile is ``benchmarks/bench_surface_mutants.py --part kernel``)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import Phase, find, settings
from hypothesis import strategies as st

from attention_crossval.kernel.adapters import streaming as streaming_adapter
from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.contract import call_options
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.properties._strategies.paged import (
    filling_page_sizes,
    page_sizes,
    seen_last_pages,
    with_pages,
)
from attention_crossval.properties._strategies.splits import draw_num_splits, split_choices
from attention_crossval.properties.kernel_suite import max_len_for
from attention_crossval.properties.strategies import attention_cases, drawn_examples
from attention_crossval.reference import paged as reference_paged
from attention_crossval.reference import splitkv as reference_splitkv
from attention_crossval.reference import streaming as reference_streaming
from attention_crossval.reference.case import AttentionCase, CausalAlignment, Mask
from attention_crossval.testing.mutants import hunt
from attention_crossval.testing.mutants_surface import (
    KERNEL_MUTANTS,
    SURFACE_MUTANTS,
    SURFACE_SPEC,
    InProcessKernel,
    hunt_kernel,
    load_surface_mutant,
    surface_mutant_kernel,
    surface_reference_cases,
    surface_trigger_case,
)

# A caught mutant's falsifying case is printed; a big one makes Hypothesis warn about its repr.
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


def _hunt(attention, surfaces=None):
    return hunt(
        attention,
        surface_reference_cases(surfaces),
        block_m=SURFACE_SPEC.tile_m,
        block_n=SURFACE_SPEC.tile_n,
        hypothesis_settings=settings(settings.default, database=None, phases=NO_SHRINK),
    )


@pytest.mark.parametrize(
    ("name", "surfaces"),
    [
        ("softcap_before_scale", ("softcap", "softcap_saturated")),
        ("sink_left_out_of_lse", ("sink", "sink_dominant", "sink_below")),
        ("sink_weight_dropped", ("sink", "sink_dominant", "sink_below")),
        ("sink_outside_running_max", ("sink_dominant",)),
    ],
)
def test_property_catches_surface_mutant(name: str, surfaces: tuple[str, ...]) -> None:
    result = _hunt(load_surface_mutant(name).streaming_attention, surfaces)
    assert result.caught, f"{name} survived {result.examples} examples"
    assert result.message.startswith("AssertionError: attention output outside the derived bound")


def test_unmutated_streaming_tier_passes_on_every_surface() -> None:
    result = _hunt(reference_streaming.streaming_attention)
    assert not result.caught, result.message
    assert result.examples == settings.default.max_examples


def test_surface_mutants_leave_the_production_modules_alone() -> None:
    modules = {m.__name__: m for m in (reference_streaming, reference_splitkv, reference_paged)}
    before = {name: inspect.getsource(module) for name, module in modules.items()}
    for name in SURFACE_MUTANTS:
        mutant = load_surface_mutant(name)
        assert mutant.__name__.startswith(f"attention_crossval.properties._mutant_{name}.")
        for mutation in SURFACE_MUTANTS[name].mutations:
            assert before[mutation.module].count(mutation.original) == 1
    assert {name: inspect.getsource(module) for name, module in modules.items()} == before


def test_kernel_mutants_leave_streaming_fa_alone() -> None:
    """A mutant kernel rebinds names in private copies of the adapter and call-option modules:
    the real ``streaming-fa`` still reads through the real split path and page lookup."""
    for name in KERNEL_MUTANTS:
        surface_mutant_kernel(name)
    assert streaming_adapter.splitkv_attention is reference_splitkv.splitkv_attention
    assert streaming_adapter.per_sequence is call_options.per_sequence
    assert call_options.read_pages is reference_paged.read_pages
    assert StreamingAdapter().combine is reference_splitkv.combine


def test_unknown_surface_mutant_is_rejected() -> None:
    with pytest.raises(ValueError, match="name="):
        load_surface_mutant("softcap_twice")
    for reject in (surface_mutant_kernel, surface_trigger_case):
        with pytest.raises(ValueError, match="name="):
            reject("softcap_before_scale")  # a streaming-tier mutant: not a kernel mutant


KERNEL_SPEC = StreamingAdapter().spec
# The kernel suite's free test draws cases of at most two K blocks and one key for a CPU kernel.
MAX_LEN = 2 * KERNEL_SPEC.tile_n + 1
# Issue 21's escapes, and the checks each must fail on its trigger case.
ESCAPES = {
    "splitkv_gqa_wrong_kv_head": ("splits",),
    "sink_once_per_split_in_combine": ("splits", "sink"),
    "last_split_dropped_when_even": ("splits",),
    "full_last_page_one_slot_late": ("paged",),
}


@pytest.mark.parametrize("name", KERNEL_MUTANTS)
def test_kernel_mutant_fails_its_trigger_case(name: str) -> None:
    case = surface_trigger_case(name)
    assert not run_case(StreamingAdapter(), case).findings
    checks = {
        f.check for f in run_case(InProcessKernel(surface_mutant_kernel(name)), case).findings
    }
    assert checks == ({"nonfinite"} if name == "combine_unguarded" else {"bound", "lse"}), checks


@pytest.mark.parametrize("name", ESCAPES)
def test_kernel_suite_property_finds_the_escape(name: str) -> None:
    """The kernel suite's property on the default strategy with the mutant's features required
    (the free strategy reaches them unrequired: the benchmark's 10-seed sweep), derandomized."""
    strategy = attention_cases(spec=KERNEL_SPEC, max_len=MAX_LEN, required_features=ESCAPES[name])
    chosen = settings(max_examples=30, database=None, phases=NO_SHRINK, derandomize=True)
    result = hunt_kernel(InProcessKernel(surface_mutant_kernel(name)), strategy, chosen)
    assert result.caught, f"{name} survived {result.examples} examples"
    assert result.message.startswith("CheckFailed: ") and "error" not in result.message


def _case(k_lengths: tuple[int, ...]) -> AttentionCase:
    B, Sk = len(k_lengths), max(k_lengths)
    q, k, v = (np.zeros((B, n, 1, 16), np.float16) for n in (1, Sk, Sk))
    return AttentionCase(q, k, v, mask=Mask(k_lengths=k_lengths))


def test_page_sizes_that_every_sequence_fills() -> None:
    assert filling_page_sizes(_case((8, 12))) == [1, 2, 4]
    assert filling_page_sizes(_case((7,))) == [1]  # one page of 7 would leave no row to fill
    assert filling_page_sizes(_case((1,))) == []
    drawn = st.composite(lambda draw: with_pages(draw, _case((8, 12)), tile_n=64).page_size)()
    assert find(drawn, lambda size: True) == 1  # shrinks to a filling size
    assert find(drawn, lambda size: size == 4) == 4
    assert find(drawn, lambda size: 12 % size != 0) in page_sizes(64)  # the others stay


def test_a_hidden_last_page_is_not_preferred() -> None:
    """Top-left causal with 7 queries over 8 keys: no query sees key 7, so a one-key last
    page hides the slot a late lookup reads; pages of 2 and 4 keys show it."""
    q, k, v = (np.zeros((1, n, 1, 16), np.float16) for n in (7, 8, 8))
    case = AttentionCase(q, k, v, mask=Mask(causal=True, alignment=CausalAlignment.TOP_LEFT))
    assert filling_page_sizes(case) == [1, 2, 4]
    assert seen_last_pages(case, [1, 2, 4]) == [2, 4]
    drawn = st.composite(lambda draw: with_pages(draw, case, tile_n=64).page_size)()
    assert find(drawn, lambda size: True) == 2  # shrinks to the smallest seen filling size


def test_the_free_strategy_fills_page_tables_whose_last_page_is_seen() -> None:
    """Over 100 derandomized draws of streaming-fa's free strategy with a page table (as the
    kernel suite draws them), at least half fill every table row to its last slot with a last
    page some query sees: where a lookup of the last page one entry late changes the output."""
    spec = StreamingAdapter().spec
    strategy = attention_cases(spec=spec, max_len=max_len_for(spec), required_features=["paged"])
    found = [
        case.page_size in seen_last_pages(case, filling_page_sizes(case))
        for case in drawn_examples(strategy, 100)
    ]
    assert len(found) == 100 and sum(found) >= 50, sum(found)


def test_split_counts_divide_the_blocks_evenly_three_times_in_four() -> None:
    case = _case((4 * 64,))  # four K blocks
    drawn = st.composite(lambda draw: draw_num_splits(draw, case, tile_n=64, max_splits=16))()
    assert find(drawn, lambda n: True) == 2  # shrinks to an even division
    assert find(drawn, lambda n: n == 4) == 4
    assert find(drawn, lambda n: 4 % n != 0) in split_choices(case, 64, 16)  # empty splits too
