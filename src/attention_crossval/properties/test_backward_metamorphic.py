"""Metamorphic properties of the streaming backward: relations between runs on related cases,
each independent of any reference gradient (bodies in :mod:`properties.backward_properties`).

* permuting the valid keys (with their explicit-mask columns) permutes dk and dv, dq unchanged;
* GQA equals the MHA expansion (k, v repeated per query head) with dk/dv summed per group;
* the directional derivative of the exact forward tier, ``<dO, dO/dx[delta]> + <dlse,
  dLSE/dx[delta]>`` by Richardson-extrapolated central differences at 128 bits, equals
  ``<dx, delta>`` for x = q, k, v: the backward is the derivative of the certified forward.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings

from attention_crossval.properties.backward_properties import (
    PROPERTIES,
    gqa_case,
    tiny_do_cancelling_v_case,
)
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.reference import streaming_backward as tier

pytestmark = pytest.mark.cpu


def _run(name: str, args: tuple) -> None:
    """Property ``name`` on the production tier; a failure saves the forward case."""
    with reproducer_on_failure(args[0].forward):
        PROPERTIES[name].check(tier, *args)


@given(PROPERTIES["key_permutation_permutes_dk_dv"].strategy)
def test_permuting_keys_permutes_dk_and_dv(args: tuple) -> None:
    """Permuting the valid keys permutes dk and dv and leaves dq alone."""
    _run("key_permutation_permutes_dk_dv", args)


@given(PROPERTIES["gqa_equals_mha_expansion"].strategy)
@example((gqa_case(),))
def test_gqa_equals_the_mha_expansion_summed_per_group(args: tuple) -> None:
    """GQA dk/dv are the MHA expansion's summed over each group; dq is the same."""
    _run("gqa_equals_mha_expansion", args)


@settings(max_examples=min(settings.default.max_examples, 12))  # 4 exact forwards per example
@given(PROPERTIES["directional_derivative"].strategy)
@example((tiny_do_cancelling_v_case(), "q", True, 1))  # the exact LSE's rounding, over 2 eps
def test_directional_derivative_matches_the_exact_forward(args: tuple) -> None:
    """<dx, delta> equals the exact forward's central difference along delta (x = q, k, v)."""
    _run("directional_derivative", args)
