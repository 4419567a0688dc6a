"""Kernel backward passes (dq, dk, dv) against the references, under the backward harness.

The kernel-suite test is parametrized over ``--kernel`` like ``test_kernels.py`` and marked by
the kernel's device: the CPU virtual kernel (streaming-fa) runs in the normal ``pytest -m cpu``
run, GPU kernels under ``-m gpu``. The backward harness's own tests are
tests/kernel/harness/test_harness_backward.py.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, seed, settings

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.known import run_backward_with_known, xfail_if_known
from attention_crossval.properties.fail_fast import run_failing_fast, stop_on_fault
from attention_crossval.properties.kernel_suite import backward_strategies, settings_for
from attention_crossval.properties.kernels_under_test import (
    chosen_kernels,
    kernel_adapter,
    kernel_param,
    kernel_spec,
)
from attention_crossval.properties.phase_timings import timed_cases
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.pytest_plugin import derived_seed, kernel_seed
from attention_crossval.reference.gradients import BackwardCase


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel" in metafunc.fixturenames:
        chosen = chosen_kernels(metafunc.config, backward=True)
        if not metafunc.config.getoption("--kernel") and "streaming-fa" not in chosen:
            chosen.insert(0, "streaming-fa")  # the CPU backward runs next to the GPU kernels
        params = [
            kernel_param(name, stream, id=f"{name}-{stream}")
            for name in chosen
            for stream in backward_streams(kernel_spec(name))
        ]
        metafunc.parametrize(("kernel", "stream"), params)


def backward_streams(spec: KernelSpec) -> list[str]:
    """The names of ``spec``'s backward strategies, one test each: a GPU kernel's backward
    cases cost seconds each (the exact tier, the bounds), and one test drawing them all was the
    longest of ``pytest -m gpu``, which separate tests spread over the xdist workers."""
    return list(backward_strategies(spec)) if spec.backward else ["none"]


# Hypothesis warns while it writes a long case's repr for its report, and that warning (an error
# here) would replace the finding the case carries.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_kernel_backward_passes_every_check(
    kernel: str, stream: str, request: pytest.FixtureRequest
) -> None:
    """Every generated backward case of the strategy ``stream`` (one of
    :func:`backward_strategies`) inside the kernel's declaration passes every check: together
    as many cases as the forward's free test draws (the profile's count, :func:`settings_for`),
    split evenly over the strategies but long keys, which draws one more such share (a tenth of
    a second a case on a CPU kernel); each seeded from the kernel's seed and its name."""
    adapter = kernel_adapter(kernel)
    spec = adapter.spec
    if not spec.backward:
        pytest.skip(f"{kernel} declares no backward")
    strategies = backward_strategies(spec)
    chosen = settings_for(spec)
    sharing = len(strategies) - ("long_keys" in strategies)
    share = settings(chosen, max_examples=max(1, chosen.max_examples // sharing))
    derived = kernel_seed(request.config, kernel)

    @share
    @given(case=timed_cases(strategies[stream]))
    def check(case: BackwardCase) -> None:
        __tracebackhide__ = True  # pytest would print the case's arrays as its argument
        verdict = run_backward_with_known(adapter, case, samples=1 if spec.device == "cpu" else 2)
        stop_on_fault(kernel, verdict)  # a crash or hang: reported as drawn, not shrunk
        assume(verdict.skipped is None)  # declined at run time (e.g. an SDPA backend's refusal)
        xfail_if_known(verdict, spec, case.forward, backward=True)  # in Hypothesis: rejected
        with reproducer_on_failure(case, kernel=kernel):  # the compact summary, a few saved
            verdict.raise_for()

    # Each strategy its own seed: one seed would draw the same shapes in every dtype.
    run = check if derived is None else seed(derived_seed(derived, stream))(check)
    run_failing_fast(kernel, request.config, run)
