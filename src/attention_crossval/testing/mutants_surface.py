"""Deliberately broken streaming tiers for the forward surface (softcap, sinks, hidden keys,
split-KV, paged KV).

Built like :mod:`testing.mutants` (textual mutation of ``reference/streaming.py``,
``reference/splitkv.py`` or ``reference/paged.py``, a snippet that disappears raises). The
softcap and sink mutants are hunted by the same float64 agreement property on
:func:`surface_reference_cases` (the reference tiers' cases with a softcap or a sink set);
``hidden_v_read`` is found by the ``hidden-nan`` harness check (``kernel.harness.hidden_nan``). The
split-KV and paged mutants (:data:`KERNEL_MUTANTS`) run inside the CPU ``streaming-fa`` kernel
(:func:`surface_mutant_kernel`), so the kernel suite's own property hunts them
(:func:`hunt_kernel`) on the default strategy; each has a trigger case
(:func:`surface_trigger_case`). The split-KV agreement property
(``tests/reference/test_splitkv.py``)
and the paged one (``tests/reference/test_paged.py``) hunt some of them at the reference level too.
"""

from __future__ import annotations

import dataclasses
import time
import types
from dataclasses import dataclass

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.execution import KernelCrashed
from attention_crossval.kernel.harness.known import covering, run_with_known
from attention_crossval.properties._strategies.surface import surface_cases
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.testing.mutants import (
    HuntResult,
    Mutant,
    Mutation,
    mutated_module,
    run_hunt,
)

STREAMING = "attention_crossval.reference.streaming"
SPLITKV = "attention_crossval.reference.splitkv"
PAGED = "attention_crossval.reference.paged"
_ADAPTER = "attention_crossval.kernel.adapters.streaming"
_CALL_OPTIONS = "attention_crossval.kernel.contract.call_options"

#: The reference tiers as a kernel that also takes a softcap and a sink.
SURFACE_SPEC = dataclasses.replace(
    REFERENCE_SPEC, name="reference-surface", softcap=True, sink=True
)


def surface_reference_cases(
    surfaces: tuple[str, ...] | None = None, **kwargs
) -> st.SearchStrategy[AttentionCase]:
    """``attention_cases(**kwargs)`` with one of ``surfaces`` (default: all) set."""
    return surface_cases(attention_cases(**kwargs), spec=SURFACE_SPEC, surfaces=surfaces)


def _lines(indent: int, *lines: str) -> str:
    """Replacement source of several lines: the first takes the original snippet's place, the
    others start ``indent`` spaces in."""
    return ("\n" + " " * indent).join(lines)


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
            "splitkv_gqa_wrong_kv_head",
            "the split path maps query head h to kv head h % Hkv, not h // (Hq / Hkv): "
            "wrong under GQA with several kv heads, right without splits",
            (
                Mutation(
                    SPLITKV,
                    "without_sink = dataclasses.replace(case, sink=None)  # splits after the first",
                    _lines(
                        4,
                        "if num_splits > 1:  # as MHA whose kv head h is kv head h % Hkv",
                        "    heads = [h % case.Hkv for h in range(case.Hq)]",
                        "    k, v = case.k[:, :, heads], case.v[:, :, heads]",
                        "    case = dataclasses.replace(case, k=k, v=v)",
                        "without_sink = dataclasses.replace(case, sink=None)",
                    ),
                ),
            ),
        ),
        Mutant(
            "sink_once_per_split_in_combine",
            "the combine folds the sink into every split's partial (split 0 already holds it): "
            "counted num_splits times, not once per row",
            (
                Mutation(
                    SPLITKV,
                    "O, lse[b, h, rows] = combine_partials(o_parts, lse_parts, accum)",
                    _lines(
                        16,
                        "if case.sink is not None:  # the sink's weight joins the later splits",
                        "    merged = np.logaddexp(lse_parts[1:], case.sink[h])",
                        "    o_parts[1:] *= np.exp(lse_parts[1:] - merged)[:, :, None]",
                        "    lse_parts[1:] = merged",
                        "O, lse[b, h, rows] = combine_partials(o_parts, lse_parts, accum)",
                    ),
                ),
            ),
        ),
        Mutant(
            "last_split_dropped_when_even",
            "the last split takes the remainder len(blocks) % per_split of the K blocks: none "
            "when they divide evenly among the splits, so its chunk is dropped",
            (
                Mutation(
                    SPLITKV,
                    "blocks[s * per_split : (s + 1) * per_split] for s in range(num_splits)]",
                    _lines(
                        4,
                        "blocks[s * per_split : s * per_split + size] for s, size in enumerate(",
                        "    [per_split] * (num_splits - 1)",
                        "    + [len(blocks) % per_split if per_split and num_splits > 1",
                        "       else per_split]",
                        ")]",
                    ),
                ),
            ),
        ),
        Mutant(
            "full_last_page_one_slot_late",
            "the last page is looked up at table entry k_len // P, not (k_len - 1) // P: one "
            "entry late when the sequence fills its last page; the table is read flat, so past a "
            "full row comes the next row's first page (past the last row, the first row's)",
            (
                Mutation(
                    PAGED,
                    "pages = paged.page_table[b, positions // paged.page_size]",
                    _lines(
                        4,
                        "index = positions // paged.page_size",
                        "if positions.size and (positions[-1] + 1) % paged.page_size == 0:",
                        "    index = np.where(index == index[-1], index + 1, index)",
                        "flat = (b * paged.page_table.shape[1] + index) % paged.page_table.size",
                        "pages = paged.page_table.ravel()[flat]",
                    ),
                ),
            ),
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
    """A fresh copy of the module that surface mutant ``name`` edits (``reference.streaming``,
    ``reference.splitkv`` or ``reference.paged``), with the mutation applied."""
    if name not in SURFACE_MUTANTS:
        raise ValueError(f"name={name!r} must be one of {sorted(SURFACE_MUTANTS)}")
    mutations = SURFACE_MUTANTS[name].mutations
    return mutated_module(mutations[0].module, list(mutations), name)


#: The mutants the CPU kernel runs (:func:`surface_mutant_kernel`): split-KV and paged ones.
KERNEL_MUTANTS = tuple(
    name for name, m in SURFACE_MUTANTS.items() if m.mutations[0].module in (SPLITKV, PAGED)
)


def surface_mutant_kernel(name: str) -> StreamingAdapter:
    """The CPU ``streaming-fa`` kernel with split-KV or paged mutant ``name`` inside: its split
    path (``splitkv_attention``) or its page lookup (``read_pages``) is the mutated one, so the
    default kernel suite can be run against it (:func:`hunt_kernel`)."""
    if name not in KERNEL_MUTANTS:
        raise ValueError(f"name={name!r} must be one of {list(KERNEL_MUTANTS)}")
    mutant = load_surface_mutant(name)
    adapter = mutated_module(_ADAPTER, [], name)  # a private copy whose imports are rebound
    if SURFACE_MUTANTS[name].mutations[0].module == SPLITKV:
        adapter.splitkv_attention = mutant.splitkv_attention
        return adapter.StreamingAdapter(combine=mutant.combine)
    call_options = mutated_module(_CALL_OPTIONS, [], name)
    call_options.read_pages = mutant.read_pages
    adapter.per_sequence = call_options.per_sequence
    return adapter.StreamingAdapter()


def surface_trigger_case(name: str) -> AttentionCase:
    """A small case on which kernel mutant ``name`` (:data:`KERNEL_MUTANTS`) fails the kernel
    suite's checks and ``streaming-fa`` passes them: gaussian float16 inputs, seed 0, D = 16,
    ``streaming-fa``'s 64-key tiles."""
    if name not in KERNEL_MUTANTS:
        raise ValueError(f"name={name!r} must be one of {list(KERNEL_MUTANTS)}")
    B, Sq, Sk, Hq, Hkv, options = {
        # GQA with two kv heads: query heads 1 and 2 read the other kv head
        "splitkv_gqa_wrong_kv_head": (1, 1, 65, 4, 2, dict(num_splits=2)),
        # a sink competing with the scores, counted twice over two splits
        "sink_once_per_split_in_combine": (1, 1, 65, 1, 1, dict(num_splits=2, sink=[0.5])),
        # two K blocks over two splits: the second split's block is dropped
        "last_split_dropped_when_even": (1, 1, 128, 1, 1, dict(num_splits=2)),
        # two sequences filling their two 4-key pages: the last page comes from the other row
        "full_last_page_one_slot_late": (2, 1, 8, 1, 1, dict(page_size=4)),
        # the other kernel mutants, each on the case its own bug class needs
        "page_lookup_off_by_one": (1, 1, 8, 1, 1, dict(page_size=4)),
        "empty_split_lse_zero": (1, 1, 65, 1, 1, dict(num_splits=3)),  # split 2 sees no key
        "sink_in_every_split": (1, 1, 65, 1, 1, dict(num_splits=2, sink=[0.5])),
        # bottom-right causal, Sq > Sk: query row 0 sees no key in any split
        "combine_unguarded": (1, 2, 1, 1, 1, dict(num_splits=2, causal=True)),
    }[name]
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal(shape).astype(np.float16)
        for shape in ((B, Sq, Hq, 16), (B, Sk, Hkv, 16), (B, Sk, Hkv, 16))
    )
    mask = Mask(causal=options.pop("causal", False))
    if "sink" in options:
        options["sink"] = np.float32(options["sink"])
    return AttentionCase(q, k, v, mask=mask, label=f"trigger of {name}", **options)


@dataclass(frozen=True)
class InProcessKernel:
    """``kernel`` called in this process, an exception it raises reported as an isolated worker
    reports it (``KernelCrashed("error")``, an ``error`` finding), so a hunt needs no worker
    (a mutated module cannot be imported by one). Floating-point warnings are silenced, as in
    a worker outside pytest: the kernel's output is judged, not its warnings."""

    kernel: StreamingAdapter

    @property
    def spec(self) -> KernelSpec:
        return self.kernel.spec

    @property
    def checks(self) -> frozenset[str]:
        return self.kernel.checks

    def __call__(self, case: AttentionCase) -> AttentionResult:
        try:
            with np.errstate(all="ignore"):
                return self.kernel(case)
        except Exception as exc:
            raise KernelCrashed("error", f"{type(exc).__name__}: {exc}") from exc


def hunt_kernel(
    adapter: InProcessKernel,
    strategy: st.SearchStrategy[AttentionCase],
    hypothesis_settings: settings,
    *,
    seed: int | None = None,
) -> HuntResult:
    """The default kernel suite's property (``properties/test_kernels.py``, the free test) on
    ``adapter``: every drawn case passes every check of the harness (a case whose every
    finding is known is rejected, as there), under ``hypothesis_settings`` and ``seed`` (None:
    Hypothesis' own). Counts the examples until the first finding, as
    :func:`testing.mutants.hunt`."""
    state = {"examples": 0, "first": None, "last": None}
    start = time.perf_counter()

    @hypothesis_settings
    @given(strategy)
    def passes_every_check(case: AttentionCase) -> None:
        verdict = run_with_known(adapter, case)
        assume(verdict.skipped is None)
        known = covering(adapter.spec, case, verdict.findings)
        assume(not known)  # the free test rejects a case whose every finding is known
        if state["first"] is None:
            state["examples"] += 1
        try:
            verdict.raise_for()
        except AssertionError:
            if state["first"] is None:
                state["first"] = (time.perf_counter() - start, case.label)
            state["last"] = case.label
            raise

    if seed is not None:
        passes_every_check = hypothesis_seed(seed)(passes_every_check)
    return run_hunt(passes_every_check, state, start)
