"""Deliberately broken streaming backward tiers, made by textual mutation, to prove that the
backward properties bite (the bug classes of the backward issue, one mutant each).

As :mod:`testing.mutants` does for the forward, each mutation replaces an exact snippet of
``reference/streaming_backward.py`` (which must occur exactly once, else
:class:`~testing.mutants.MutantRotError`) and executes the result as a fresh module. Every
mutant names the property of :data:`properties.backward_properties.PROPERTIES` that must catch
it and an explicit example on which it does, so the catch is asserted without any randomness;
:func:`hunt_backward` measures how many generated examples each property needs.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import example, given, settings

from attention_crossval.properties.backward_properties import (
    PROPERTIES,
    BackwardProperty,
    gqa_case,
    tiny_do_cancelling_v_case,
)
from attention_crossval.testing.mutants import HuntResult, Mutation, mutated_module, run_hunt

MODULE = "attention_crossval.reference.streaming_backward"


def _edit(original: str, replacement: str) -> Mutation:
    return Mutation(MODULE, original, replacement)


@dataclass(frozen=True)
class BackwardMutant:
    """A named backward bug: the source edits that make it, the property that must catch it,
    and the arguments (after the tier) of an example on which that property fails."""

    name: str
    bug: str
    mutations: tuple[Mutation, ...]
    caught_by: str
    example: Callable[[], tuple]


BACKWARD_MUTANTS: dict[str, BackwardMutant] = {
    m.name: m
    for m in (
        BackwardMutant(
            "missing_d_term",
            "dS = P * dP: the preprocessed D = rowsum(dO * O) is never subtracted",
            (_edit("dS = P_ds * (dP - D[:, None])", "dS = P_ds * dP"),),
            "ds_rows_sum_to_dlse",
            lambda: (gqa_case(), False),
        ),
        BackwardMutant(
            "gqa_first_head_only",
            "dK/dV of a kv head take only the first query head of its group, not the sum",
            (
                _edit(
                    "dk_acc[b, cols, kv_head] += dK",
                    "dk_acc[b, cols, kv_head] += dK * (h % fwd.group_size == 0)",
                ),
                _edit(
                    "dv_acc[b, cols, kv_head] += dV",
                    "dv_acc[b, cols, kv_head] += dV * (h % fwd.group_size == 0)",
                ),
            ),
            "gqa_equals_mha_expansion",
            lambda: (gqa_case(),),
        ),
        BackwardMutant(
            "dq_out_of_order",
            "deterministic mode adds the K blocks' dQ partials in the atomic (seeded) order",
            (_edit('if dq_order == "fixed":', 'if dq_order == "never":'),),
            "deterministic_across_seeds",
            lambda: (gqa_case(), 1),
        ),
        BackwardMutant(
            "stale_lse",
            "P recomputed from the LSE loaded for the previous Q block",
            (
                _edit(
                    "LSE2_all[rows]",
                    "np.roll(LSE2_all, rows.stop - rows.start)[rows]",
                ),
            ),
            "p_rows_sum_to_one",
            lambda: (gqa_case(),),
        ),
        BackwardMutant(
            "last_k_block_skipped",
            "the K/V block loop stops one block early: the last keys get no dK/dV and add no dQ",
            (
                _edit(
                    "for n0 in range(0, k_len, block_n)]",
                    "for n0 in range(0, k_len, block_n)][:-1]",
                ),
            ),
            "float64_matches_exact",
            lambda: (gqa_case(),),
        ),
        BackwardMutant(
            "dlse_sign_flipped",
            "D = rowsum(dO * O) + dlse: the LSE's gradient enters dS with the wrong sign",
            (
                _edit(
                    "D = D - case.dlse[b, h, :q_len].astype(acc)",
                    "D = D + case.dlse[b, h, :q_len].astype(acc)",
                ),
            ),
            "directional_derivative",
            lambda: (tiny_do_cancelling_v_case(), "q", True, 1),
        ),
        BackwardMutant(
            "padding_read",
            "the loops run over the padded Sq x Sk: padded q, k, v and dO rows are read",
            (
                _edit(
                    "q_len, k_len = fwd.q_length(b), fwd.k_length(b)",
                    "q_len, k_len = fwd.Sq, fwd.Sk",
                ),
            ),
            "zero_gradient_where_unseen",
            lambda: (gqa_case(), "bfloat16"),
        ),
    )
}


def load_backward_mutant(name: str) -> types.ModuleType:
    """A fresh ``reference.streaming_backward`` module with mutant ``name`` applied."""
    if name not in BACKWARD_MUTANTS:
        raise ValueError(f"name={name!r} must be one of {sorted(BACKWARD_MUTANTS)}")
    return mutated_module(MODULE, list(BACKWARD_MUTANTS[name].mutations), name)


def hunt_backward(
    tier: types.ModuleType,
    prop: BackwardProperty,
    hypothesis_settings: settings,
    explicit: tuple | None = None,
) -> HuntResult:
    """Run ``prop`` on ``tier`` under ``hypothesis_settings`` (``explicit`` first, if given)
    until it fails; examples are counted up to the first failure. Only an ``AssertionError``
    is a catch; any other error propagates. Floating-point warnings are silenced."""
    state = {"examples": 0, "first": None, "last": None}
    start = time.perf_counter()

    def check(args: tuple) -> None:
        if state["first"] is None:
            state["examples"] += 1
        try:
            with np.errstate(all="ignore"):  # a kernel does not warn: its output is judged
                prop.check(tier, *args)
        except AssertionError:
            if state["first"] is None:
                state["first"] = (time.perf_counter() - start, args[0].label)
            state["last"] = args[0].label
            raise

    test = given(prop.strategy)(check)
    if explicit is not None:
        test = example(explicit)(test)
    return run_hunt(hypothesis_settings(test), state, start)


__all__ = [
    "BACKWARD_MUTANTS",
    "PROPERTIES",
    "BackwardMutant",
    "hunt_backward",
    "load_backward_mutant",
]
