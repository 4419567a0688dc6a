"""The strict-xfail test per declared known finding (kernel/contract/known_findings.py) of each
kernel under
test (``--kernel``; by default the GPU built-ins, the CPU divergent adapters of
testing/broken/cpu_known.py and the paged one of testing/broken/cpu_call_options.py). It asserts
the known check passes on the finding's trigger case, so it xfails while the divergence lasts
and an upstream fix fails it (XPASS strict). Each test is marked cpu or gpu by its kernel's
device.
"""

from __future__ import annotations

import pytest

from attention_crossval.kernel.contract.known_findings import backward_trigger_case, trigger_case
from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.properties.kernel_suite import KNOWN_FINDING_KERNELS
from attention_crossval.properties.kernels_under_test import (
    kernel_adapter,
    kernel_param,
    kernel_spec,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "known_kernel" not in metafunc.fixturenames:
        return
    params = []
    for name in metafunc.config.getoption("--kernel") or KNOWN_FINDING_KERNELS:
        spec = kernel_spec(name)
        for index, known in enumerate(spec.known_findings):
            expected = pytest.mark.xfail(strict=True, raises=CheckFailed, reason=str(known))
            features = "".join(f"-{f}" for f in sorted(known.features))  # -paged: its own id
            test_id = f"{spec.name}-{known.name}{features}"
            params.append(kernel_param(name, index, marks=(expected,), id=test_id))
    if not params:  # no kernel under test declares a known finding: one visible skip
        skip = pytest.mark.skip(reason="no kernel under test declares a known finding")
        params = [pytest.param(None, None, marks=[pytest.mark.cpu, skip])]
    metafunc.parametrize(("known_kernel", "known_index"), params)


def test_known_finding_still_reproduces(known_kernel: str, known_index: int) -> None:
    """The known check passes on its trigger case: false (xfail) until the kernel is fixed."""
    adapter = kernel_adapter(known_kernel)
    known = adapter.spec.known_findings[known_index]
    if known.backward:
        verdict = run_backward_case(adapter, backward_trigger_case(adapter.spec, known))
    else:
        verdict = run_case(adapter, trigger_case(adapter.spec, known))
    if verdict.skipped is not None:
        pytest.skip(f"trigger case skipped: {verdict.skipped}")
    verdict.raise_for(known.check)
