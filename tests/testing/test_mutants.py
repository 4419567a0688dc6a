"""testing/mutants.py: the float64 agreement property catches every broken streaming tier.

Each mutant is hunted with ``attention_cases()`` for the loaded profile's ``max_examples``,
derandomized (the same cases on every run, whatever the run's seed) and without the shrink
phase (catching is what is tested; ``benchmarks/bench_mutants.py`` also shrinks and times it).
A random hunt let ``partial_last_block_unmasked`` escape in 2 of 12 dev-profile runs; derandomized,
the outcome is a property of the tree, not of the draw. Each mutant's hand-made trigger case
catches it too, whatever the strategies draw. The unmutated tier must survive both (the control).
"""

from __future__ import annotations

import inspect

import pytest
from hypothesis import Phase, settings
from hypothesis.errors import FailedHealthCheck, FlakyFailure

from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference import streaming as reference_streaming
from attention_crossval.testing.mutants import (
    MUTANTS,
    MutantRotError,
    Mutation,
    hunt,
    is_a_catch,
    load_mutant,
    mutated_module,
    trigger_case,
)

pytestmark = pytest.mark.cpu

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


DERANDOMIZED = settings(settings.default, database=None, phases=NO_SHRINK, derandomize=True)
TRIGGERS_ONLY = settings(settings.default, database=None, phases=(Phase.explicit,))


def _hunt(attention, *, examples=(), hypothesis_settings=DERANDOMIZED):
    return hunt(
        attention,
        attention_cases(),
        block_m=REFERENCE_SPEC.tile_m,
        block_n=REFERENCE_SPEC.tile_n,
        hypothesis_settings=hypothesis_settings,
        examples=examples,
    )


def _triggers() -> tuple:
    return tuple(trigger_case(name, block_n=REFERENCE_SPEC.tile_n) for name in MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_property_catches_mutant(name: str) -> None:
    result = _hunt(load_mutant(name).streaming_attention)
    assert result.caught, f"{name} survived {result.examples} examples"
    assert result.message.startswith("AssertionError: attention output outside the derived bound")


@pytest.mark.parametrize("name", list(MUTANTS))
def test_trigger_case_catches_mutant(name: str) -> None:
    trigger = trigger_case(name, block_n=REFERENCE_SPEC.tile_n)
    result = _hunt(
        load_mutant(name).streaming_attention,
        examples=(trigger,),
        hypothesis_settings=TRIGGERS_ONLY,
    )
    assert result.caught and result.first_label == trigger.label, result
    assert result.message.startswith("AssertionError: attention output outside the derived bound")


def test_unmutated_streaming_tier_passes_the_same_property() -> None:
    result = _hunt(reference_streaming.streaming_attention, examples=_triggers())
    assert not result.caught, result.message
    assert result.examples == settings.default.max_examples + len(MUTANTS)


def test_mutants_leave_the_production_module_alone() -> None:
    before = inspect.getsource(reference_streaming)
    for name in MUTANTS:
        assert load_mutant(name).streaming_attention is not reference_streaming.streaming_attention
    assert inspect.getsource(reference_streaming) == before
    assert "m_safe = np.where(row_max == -np.inf, 0, row_max)" in before


def test_a_rotted_snippet_is_an_error_not_a_silent_no_op() -> None:
    rotted = Mutation(
        "attention_crossval.reference.streaming", "this line is not in streaming.py", "pass"
    )
    with pytest.raises(MutantRotError, match="occurs 0 times"):
        mutated_module("attention_crossval.reference.streaming", [rotted], "rotted")
    duplicated = Mutation("attention_crossval.reference.streaming", "import", "import")
    with pytest.raises(MutantRotError, match="must be exactly once"):
        mutated_module("attention_crossval.reference.streaming", [duplicated], "duplicated")


def test_unknown_mutant_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="name="):
        load_mutant("off_by_two")


def test_only_an_assertion_counts_as_a_catch() -> None:
    """Infrastructure errors (a crashing kernel, a failed health check) must propagate, not be
    reported as the property catching a bug."""

    def crashes(*args, **kwargs):
        raise ValueError("infrastructure failure, not a wrong answer")

    with pytest.raises(ValueError, match="infrastructure failure"):
        _hunt(crashes)
    with pytest.raises(FailedHealthCheck):
        hunt(
            reference_streaming.streaming_attention,
            attention_cases().filter(lambda case: False),
            block_m=REFERENCE_SPEC.tile_m,
            block_n=REFERENCE_SPEC.tile_n,
            hypothesis_settings=settings(settings.default, database=None, phases=NO_SHRINK),
        )
    assert not is_a_catch(FlakyFailure("flaky", [AssertionError("once")]))
    assert is_a_catch(ExceptionGroup("two bugs", [AssertionError("a"), AssertionError("b")]))
    assert not is_a_catch(ExceptionGroup("mixed", [AssertionError("a"), ValueError("b")]))
