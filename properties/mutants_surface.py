"""Deliberately broken streaming tiers for the forward surface (softcap, sinks, hidden keys).

Built like :mod:`properties.mutants` (textual mutation of ``reference/streaming.py``, a snippet
that disappears raises). The softcap and sink mutants are hunted by the same float64 agreement
property on :func:`surface_reference_cases` (the reference tiers' cases with a softcap or a sink
set); ``hidden_v_read`` is found by the ``hidden-nan`` harness check (``kernel.hidden_nan``);
the split-KV combine mutants (``reference/splitkv.py``) by the split-KV agreement property
(``properties/test_splitkv.py``); the page-table mutant by the paged agreement property
(``properties/test_paged.py``).
"""

from __future__ import annotations

import dataclasses
import types

from hypothesis import strategies as st

from attention_crossval.properties._strategies.surface import surface_cases
from attention_crossval.properties.mutants import Mutant, Mutation, mutated_module
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.case import AttentionCase

STREAMING = "attention_crossval.reference.streaming"
SPLITKV = "attention_crossval.reference.splitkv"
PAGED = "attention_crossval.reference.paged"

#: The reference tiers as a kernel that also takes a softcap and a sink.
SURFACE_SPEC = dataclasses.replace(
    REFERENCE_SPEC, name="reference-surface", softcap=True, sink=True
)


def surface_reference_cases(
    surfaces: tuple[str, ...] | None = None, **kwargs
) -> st.SearchStrategy[AttentionCase]:
    """``attention_cases(**kwargs)`` with one of ``surfaces`` (default: all) set."""
    return surface_cases(attention_cases(**kwargs), spec=SURFACE_SPEC, surfaces=surfaces)


SURFACE_MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant(
            "softcap_before_scale",
            "the cap acts on the unscaled scores and the scale multiplies the capped logits",
            (
                Mutation(
                    STREAMING,
                    "S = cap * np.tanh(S * scale / cap)",
                    "S = cap * np.tanh(S / cap) * scale",
                ),
            ),
        ),
        Mutant(
            "sink_left_out_of_lse",
            "the LSE is taken from the row sum without the sink's weight (O is right)",
            (
                Mutation(
                    STREAMING,
                    "lse = (row_max.astype(accum_dtype) * scale_log2 + np.log2(row_sum_safe))",
                    "sink_weight = 0 if case.sink is None else np.exp2("
                    "case.sink[h] * LOG2_E - row_max.astype(accum_dtype) * scale_log2)\n"
                    "    lse = (row_max.astype(accum_dtype) * scale_log2"
                    " + np.log2(row_sum_safe - sink_weight))",
                ),
            ),
        ),
        Mutant(
            "sink_weight_dropped",
            "the sink sets the starting max but its weight never enters row_sum",
            (Mutation(STREAMING, "row_sum[:] = 1", "row_sum[:] = 0"),),
        ),
        Mutant(
            "sink_outside_running_max",
            "the sink joins the row sum only at the end, scaled by the scores' max: a sink "
            "more than 88 above every score overflows float32 (flash-attn-cute's finding)",
            (
                Mutation(
                    STREAMING,
                    "row_max[:] = score_dtype.type(case.sink[h]) * score_dtype.type(LOG2_E) "
                    "/ scale_log2\n        row_sum[:] = 1",
                    "pass",
                ),
                Mutation(
                    STREAMING,
                    "row_sum_safe = np.where(row_sum > 0, row_sum, 1)",
                    "if case.sink is not None:\n"
                    "        sink2 = score_dtype.type(case.sink[h]) * score_dtype.type(LOG2_E)\n"
                    "        row_max = np.where(row_max == -np.inf, sink2 / scale_log2, row_max)\n"
                    "        row_sum = row_sum + np.exp2(sink2 - row_max * scale_log2)\n"
                    "    row_sum_safe = np.where(row_sum > 0, row_sum, 1)",
                ),
            ),
        ),
        Mutant(
            "hidden_v_read",
            "V rows that no query sees are read and weighted by 0 (0 * NaN = NaN)",
            (Mutation(STREAMING, "V = np.where(seen.any(axis=0)[:, None], V, 0)", "V = V"),),
        ),
        Mutant(
            "page_lookup_off_by_one",
            "the page table is read one entry too far: key j comes from page j // P + 1",
            (
                Mutation(
                    PAGED,
                    "pages = paged.page_table[b, positions // paged.page_size]",
                    "pages = paged.page_table[b, np.minimum(positions // paged.page_size + 1, "
                    "paged.page_table.shape[1] - 1)]",
                ),
            ),
        ),
        Mutant(
            "empty_split_lse_zero",
            "the combine reads an empty split's LSE = -inf as 0: it gains weight exp(-m)",
            (
                Mutation(
                    SPLITKV,
                    "weights = np.exp(lse_parts - m_safe)",
                    "weights = np.exp(np.where(lse_parts == -np.inf, 0, lse_parts) - m_safe)",
                ),
            ),
        ),
        Mutant(
            "sink_in_every_split",
            "every split starts from the sink, so the combine counts it num_splits times",
            (Mutation(SPLITKV, "case if s == 0 else without_sink", "case"),),
        ),
        Mutant(
            "combine_unguarded",
            "the combine subtracts an all -inf max: every split empty gives NaN, not O = 0",
            (
                Mutation(
                    SPLITKV, "m_safe = np.where(lse_max == -np.inf, 0, lse_max)", "m_safe = lse_max"
                ),
            ),
        ),
    )
}


def load_surface_mutant(name: str) -> types.ModuleType:
    """A fresh copy of the module that surface mutant ``name`` edits (``reference.streaming``
    or ``reference.splitkv``), with the mutation applied."""
    if name not in SURFACE_MUTANTS:
        raise ValueError(f"name={name!r} must be one of {sorted(SURFACE_MUTANTS)}")
    mutations = SURFACE_MUTANTS[name].mutations
    return mutated_module(mutations[0].module, list(mutations), name)
