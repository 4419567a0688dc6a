"""properties/mutants_surface.py: the float64 agreement property, run on softcap and sink cases,
catches each broken streaming tier; the unmutated tier passes the same property."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import Phase, settings

from attention_crossval.properties.mutants import hunt
from attention_crossval.properties.mutants_surface import (
    SURFACE_MUTANTS,
    SURFACE_SPEC,
    load_surface_mutant,
    surface_reference_cases,
)
from attention_crossval.reference import paged as reference_paged
from attention_crossval.reference import splitkv as reference_splitkv
from attention_crossval.reference import streaming as reference_streaming

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


def test_unknown_surface_mutant_is_rejected() -> None:
    with pytest.raises(ValueError, match="name="):
        load_surface_mutant("softcap_twice")
