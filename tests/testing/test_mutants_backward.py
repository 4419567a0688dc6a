"""testing/mutants_backward.py: every broken streaming backward is caught by its named
property, deterministically: on the mutant's explicit example, and under derandomized
generation (no explicit example, no database, no shrinking)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

from attention_crossval.properties.backward_properties import PROPERTIES
from attention_crossval.reference import streaming_backward as tier
from attention_crossval.testing.mutants_backward import (
    BACKWARD_MUTANTS,
    hunt_backward,
    load_backward_mutant,
)

pytestmark = pytest.mark.cpu

DERANDOMIZED = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.generate,),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("name", list(BACKWARD_MUTANTS))
def test_named_property_catches_mutant_on_its_example(name: str) -> None:
    """The named property fails on the mutant and passes on the production tier, same input."""
    mutant = BACKWARD_MUTANTS[name]
    check = PROPERTIES[mutant.caught_by].check
    check(tier, *mutant.example())
    with pytest.raises(AssertionError), np.errstate(all="ignore"):  # judged, not warned
        check(load_backward_mutant(name), *mutant.example())


@pytest.mark.parametrize("name", list(BACKWARD_MUTANTS))
def test_named_property_catches_mutant_under_generation(name: str) -> None:
    mutant = BACKWARD_MUTANTS[name]
    result = hunt_backward(load_backward_mutant(name), PROPERTIES[mutant.caught_by], DERANDOMIZED)
    assert result.caught, f"{name} survived {result.examples} examples of {mutant.caught_by}"


def test_mutants_leave_the_production_module_alone() -> None:
    before = inspect.getsource(tier)
    for name in BACKWARD_MUTANTS:
        assert load_backward_mutant(name).streaming_backward is not tier.streaming_backward
    assert inspect.getsource(tier) == before
    assert "dS = P_ds * (dP - D[:, None])" in before


def test_unknown_backward_mutant_is_rejected() -> None:
    with pytest.raises(ValueError, match="name='no_such_bug' must be one of"):
        load_backward_mutant("no_such_bug")
