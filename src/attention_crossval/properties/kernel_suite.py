"""The kernel suite's machinery, shared by its test files (test_kernels.py,
test_kernels_backward.py) and by the tests of the project's own kernels: the settings and
lengths per kernel, the seed streams, the property run that turns a verdict into a pass, an
xfail or a compact failure, and the strategies of the sweeps."""

from __future__ import annotations

import pytest
from hypothesis import Verbosity, assume, event, given, seed, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.known import covering, run_with_known, xfail_if_known
from attention_crossval.kernel.harness.registry import GPU_BUILTIN
from attention_crossval.properties.fail_fast import run_failing_fast, stop_on_fault
from attention_crossval.properties.kernels_under_test import (
    kernel_adapter,
    kernel_spec,
)
from attention_crossval.properties.phase_timings import timed_cases
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import (
    attention_cases,
    backward_cases,
    long_key_backward_cases,
    long_key_lengths,
    spec_features,
)
from attention_crossval.pytest_plugin import kernel_seed
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.gradients import BackwardCase

# A CPU kernel's free test stays at most two K blocks plus one key long (GPU kernels: four), and
# at most 30 examples (the profile's count if lower): streaming-fa's free test would take
# minutes with four blocks and 60 examples.
CPU_MAX_EXAMPLES = 30
# Per sweep pair: Hypothesis' simplest case first, then one drawn from the pair's own seed, with
# lengths to SWEEP_BLOCKS K blocks and one key.
SWEEP_EXAMPLES = 2
SWEEP_BLOCKS = 8
# The value classes each feature has, which its sweep draws one case more than (the simplest
# first): the surfaces of softcap (plain, saturated, with a sink) and sink (competing,
# dominant, below, with a softcap); page sizes that divide the K block or not; split counts at
# most and above the K blocks; varlen batches as a decode or not; long decodes of 1, 2 and 16
# queries. Others: one class.
FEATURE_CLASSES = {
    "softcap": 3,
    "sink": 4,
    "paged": 2,
    "splits": 2,
    "varlen_batch": 2,
    "long_decode": 3,
}
# The free test's seed stream: each other test of a kernel (a sweep pair, a feature, another
# file's run of the free property) names its own stream, so no two draw the same cases.
FREE = "free"


def settings_for(spec: KernelSpec, max_examples: int | None = None) -> settings:
    """The profile's settings, quiet (Hypothesis would print the drawn case with its arrays: the
    failure message carries a compact summary instead), without the example database (a
    kernel's cases come from its seed), at most :data:`CPU_MAX_EXAMPLES` for a CPU kernel."""
    examples = settings.default.max_examples if max_examples is None else max_examples
    if spec.device == "cpu":
        examples = min(examples, CPU_MAX_EXAMPLES)
    return settings(
        settings.default, verbosity=Verbosity.quiet, database=None, max_examples=examples
    )


def max_len_for(spec: KernelSpec, blocks: int | None = None) -> int:
    """``blocks`` K blocks and one key; by default (the free test) four for a GPU kernel, two
    for a CPU kernel."""
    blocks = blocks or (4 if spec.device == "cuda" else 2)
    return min(blocks * spec.tile_n + 1, spec.max_seqlen)


def stream_name(kernel: str, stream: str) -> str:
    """What one of ``kernel``'s tests derives its seed from: the free test (:data:`FREE`)
    the kernel's name (its cases stay what they were), every other stream its own name too."""
    return kernel if stream == FREE else f"{kernel}:{stream}"


def stream_seed(config: pytest.Config, kernel: str, stream: str) -> int | None:
    """The Hypothesis seed of one of ``kernel``'s tests (:func:`kernel_seed` of
    :func:`stream_name`), or None (random)."""
    return kernel_seed(config, stream_name(kernel, stream))


def run_property(
    kernel: str,
    config: pytest.Config,
    strategy: st.SearchStrategy[AttentionCase],
    chosen: settings,
    *,
    stream: str,
    count_known: bool = False,
) -> list[AttentionCase]:
    """Check every case ``strategy`` draws under ``chosen``, seeded for ``kernel`` and
    ``stream`` from the run's seed (:func:`stream_seed`); returns the cases that ran (declined
    ones excluded). A finding fails with the compact summary and the saved case's replay
    command (at most a few cases saved per test, the shrunk one always). A case whose every
    finding is known is rejected, so Hypothesis draws another (the free test searches past
    known findings), or, with ``count_known`` (the sweeps), counted as run: it passed every
    other check, and rejecting it made a two-example sweep draw up to 458 replacements where
    known findings cover most of a feature's cases (docs/forward-surface.md, "Default
    strategy and coverage")."""
    __tracebackhide__ = True
    adapter = kernel_adapter(kernel)
    ran: list[AttentionCase] = []

    @chosen
    @given(case=timed_cases(strategy))
    def check(case: AttentionCase) -> None:
        __tracebackhide__ = True  # pytest would print the case's arrays as this frame's argument
        verdict = run_with_known(adapter, case)
        stop_on_fault(kernel, verdict, case)  # a crash or hang: reported as drawn, not shrunk
        assume(verdict.skipped is None)  # declined by the kernel at run time
        known = covering(adapter.spec, case, verdict.findings)
        if count_known and known:
            event(f"known, counted: {', '.join(k.check for k in known)}")
            ran.append(case)
            return
        xfail_if_known(verdict, adapter.spec, case)  # inside Hypothesis: the example is rejected
        ran.append(case)
        with reproducer_on_failure(case, kernel=kernel):
            verdict.raise_for()

    derived = stream_seed(config, kernel, stream)
    run_failing_fast(kernel, config, check if derived is None else seed(derived)(check))
    return ran


# A GPU kernel's free test runs as this many tests (parts), each drawing its share of the
# profile's examples from its own seed stream: one test drawing them all was the longest of
# `pytest -m gpu` on the H200 (flex-attention's 306 s, compiles included), and parts spread
# over the xdist workers. A CPU kernel's stays one test (its examples are capped anyway).
GPU_FREE_PARTS = 4


def free_parts(spec: KernelSpec) -> int:
    """How many tests the free property of ``spec``'s kernel runs as."""
    return GPU_FREE_PARTS if spec.device == "cuda" else 1


def free_property(
    kernel: str, config: pytest.Config, stream: str = FREE, *, part: int = 0, parts: int = 1
) -> None:
    """The free property: every case drawn inside the kernel's declaration passes every
    applicable check; ``stream`` names the seed stream (another file's run of it names its
    own, so it draws other cases). Run as ``parts`` tests, ``part`` draws its share of the
    examples from a stream of its own (part 0: ``stream`` itself)."""
    if not 0 <= part < parts:
        raise ValueError(f"part={part} must lie in [0, parts={parts})")
    spec = kernel_spec(kernel)
    strategy = attention_cases(spec=spec, max_len=max_len_for(spec))
    chosen = settings_for(spec)
    if parts > 1:
        chosen = settings(chosen, max_examples=max(1, -(-chosen.max_examples // parts)))
    stream = stream if part == 0 else f"{stream}:part{part}"
    ran = run_property(kernel, config, strategy, chosen, stream=stream)
    assert ran, f"{kernel} declined every case drawn: nothing was checked"


def sweep_strategy(spec: KernelSpec, distribution: str, mask_kind: str):
    """The cases of one (distribution, mask kind) sweep pair: the base features (varlen
    batches of 3+, long decode) stay in, lengths reach :data:`SWEEP_BLOCKS` K blocks."""
    return attention_cases(
        spec=spec,
        max_len=max_len_for(spec, SWEEP_BLOCKS),
        distributions=[distribution],
        required_mask_kinds=() if mask_kind == "none" else (mask_kind,),
    )


def feature_strategy(spec: KernelSpec, feature: str):
    """The cases of one feature's sweep (``hidden`` under a window where the kernel has no
    explicit masks), lengths to :data:`SWEEP_BLOCKS` K blocks."""
    window = feature == "hidden" and "explicit" not in spec.mask_kinds
    return attention_cases(
        spec=spec,
        max_len=max_len_for(spec, SWEEP_BLOCKS),
        required_features=[feature],
        required_mask_kinds=("window",) if window else (),
    )


def feature_examples(feature: str) -> int:
    """Cases per feature sweep: the simplest, then one per value class (:data:`FEATURE_CLASSES`)."""
    return 1 + FEATURE_CLASSES.get(feature, 1)


# Key blocks the longest drawn case spans (plus one key): lengths cluster at the tile edges below
# it, so three or more blocks (where a dQ summed out of order shows in its bits) are common.
BACKWARD_KEY_BLOCKS = 8


def backward_max_len(spec: KernelSpec) -> int:
    """The longest Sq / Sk drawn for ``spec``'s backward: eight K tiles and one key."""
    return min(BACKWARD_KEY_BLOCKS * spec.tile_n + 1, spec.max_seqlen)


def backward_strategies(spec: KernelSpec) -> dict[str, st.SearchStrategy[BackwardCase]]:
    """The backward test's strategies, named: one per declared dtype, so that a bug of one
    dtype's chain (a dS rounded wrongly under fp16, a dQ order visible only in fp32 bits) meets
    its share of the cases in every run, which one draw over all dtypes does not promise; long
    keys (one or two queries over 1024+ keys, eight K blocks or more, mostly the
    ``swamped_dq`` pattern: a dQ accumulated in 16 bits across the K blocks loses its small
    terms); and for a GPU kernel declaring it, a long decode (a few queries over 4096+ keys).
    On a CPU kernel long decodes and more than two heads (GQA 2:1 stays) cost seconds a case
    on the two cores CI has; a long-key case with D <= 16 costs about a tenth of one."""
    cpu = spec.device == "cpu"
    options = {"spec": spec, "max_len": backward_max_len(spec), "max_heads": 2 if cpu else 4}
    named = {f"dtype={d}": backward_cases(dtypes=[d], **options) for d in sorted(spec.dtypes)}
    if spec.max_seqlen >= long_key_lengths(spec.tile_n)[-1]:
        named["long_keys"] = long_key_backward_cases(
            spec=spec, max_heads=options["max_heads"], max_head_dim=16 if cpu else 64
        )
    if not cpu and "long_decode" in spec_features(spec):
        named["long_decode"] = backward_cases(required_features=["long_decode"], **options)
    return named


# The kernels whose declared known findings the strict test replays by default: the GPU
# built-ins and the CPU kernels that declare one (fixtures the suite's own tests use).
_CPU_KNOWN = "attention_crossval.testing.broken.cpu_known"
KNOWN_FINDING_KERNELS = (
    *GPU_BUILTIN,
    f"{_CPU_KNOWN}:hidden_rows",
    f"{_CPU_KNOWN}:reads_padding",
    "attention_crossval.testing.broken.cpu_call_options:reads_page_tail",
)
