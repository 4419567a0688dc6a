"""Kernel backward passes (dq, dk, dv) against the references, under the backward harness.

The kernel-suite test is parametrized over ``--kernel`` like ``test_kernels.py`` and marked by
the kernel's device: the CPU virtual kernel (streaming-fa) runs in the normal ``pytest -m cpu``
run, GPU kernels under ``-m gpu``. The backward harness's own tests are
tests/kernel/harness/test_harness_backward.py.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, seed, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.known import run_backward_with_known, xfail_if_known
from attention_crossval.properties.fail_fast import run_failing_fast, stop_on_fault
from attention_crossval.properties.kernel_suite import (  # noqa: F401 - the autouse fixture
    close_workers_at_module_end,
    settings_for,
)
from attention_crossval.properties.kernels_under_test import (
    chosen_kernels,
    kernel_adapter,
    kernel_param,
)
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import backward_cases, spec_features
from attention_crossval.pytest_plugin import derived_seed, kernel_seed
from attention_crossval.reference.gradients import BackwardCase


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel" in metafunc.fixturenames:
        chosen = chosen_kernels(metafunc.config, backward=True)
        if not metafunc.config.getoption("--kernel") and "streaming-fa" not in chosen:
            chosen.insert(0, "streaming-fa")  # the CPU backward runs next to the GPU kernels
        metafunc.parametrize("kernel", [kernel_param(name, id=name) for name in chosen])


# Key blocks the longest drawn case spans (plus one key): lengths cluster at the tile edges below
# it, so three or more blocks (where a dQ summed out of order shows in its bits) are common.
BACKWARD_KEY_BLOCKS = 8


def backward_max_len(spec: KernelSpec) -> int:
    """The longest Sq / Sk drawn for ``spec``'s backward: eight K tiles and one key."""
    return min(BACKWARD_KEY_BLOCKS * spec.tile_n + 1, spec.max_seqlen)


def backward_strategies(spec: KernelSpec) -> dict[str, st.SearchStrategy[BackwardCase]]:
    """The backward test's strategies, named: one per declared dtype, so that a bug of one
    dtype's chain (a dS rounded wrongly under fp16, a dQ order visible only in fp32 bits) meets
    its share of the cases in every run, which one draw over all dtypes does not promise; and
    for a GPU kernel declaring it, a long decode (a few queries over 4096+ keys, where a dQ
    accumulated in 16 bits drifts over many K blocks). On a CPU kernel long decodes and more
    than two heads (GQA 2:1 stays) cost seconds a case on the two cores CI has."""
    cpu = spec.device == "cpu"
    options = {"spec": spec, "max_len": backward_max_len(spec), "max_heads": 2 if cpu else 4}
    named = {f"dtype={d}": backward_cases(dtypes=[d], **options) for d in sorted(spec.dtypes)}
    if not cpu and "long_decode" in spec_features(spec):
        named["long_decode"] = backward_cases(required_features=["long_decode"], **options)
    return named


# Hypothesis warns while it writes a long case's repr for its report, and that warning (an error
# here) would replace the finding the case carries.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_kernel_backward_passes_every_check(kernel: str, request: pytest.FixtureRequest) -> None:
    """Every generated backward case inside the kernel's declaration passes every check: as many
    cases as the forward's free test draws (the profile's count, :func:`settings_for`), split
    evenly over :func:`backward_strategies`, each seeded from the kernel's seed and its name."""
    adapter = kernel_adapter(kernel)
    spec = adapter.spec
    if not spec.backward:
        pytest.skip(f"{kernel} declares no backward")
    strategies = backward_strategies(spec)
    chosen = settings_for(spec)
    share = settings(chosen, max_examples=max(1, chosen.max_examples // len(strategies)))
    derived = kernel_seed(request.config, kernel)
    for name, strategy in strategies.items():

        @share
        @given(case=strategy)
        def check(case: BackwardCase) -> None:
            __tracebackhide__ = True  # pytest would print the case's arrays as its argument
            verdict = run_backward_with_known(
                adapter, case, samples=1 if spec.device == "cpu" else 2
            )
            stop_on_fault(kernel, verdict)  # a crash or hang: reported as drawn, not shrunk
            assume(verdict.skipped is None)  # declined at run time (e.g. an SDPA backend's refusal)
            xfail_if_known(verdict, spec, case.forward, backward=True)  # in Hypothesis: rejected
            with reproducer_on_failure(case, kernel=kernel):  # the compact summary, a few saved
                verdict.raise_for()

        # Each strategy its own seed: one seed would draw the same shapes in every dtype.
        run = check if derived is None else seed(derived_seed(derived, name))(check)
        run_failing_fast(kernel, request.config, run)
