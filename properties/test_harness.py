"""The defensive harness and the registry on CPU: every check fires on the fault it names.

The faulty kernels are in ``kernel/broken/cpu_faults.py``; the isolation tests spawn a real
worker process that hangs, exits or raises, and check the run goes on with a fresh worker.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

from kernel import registry
from kernel.broken.cpu_faults import FaultyAdapter, GuardedNumpyAdapter
from kernel.harness import CheckFailed, IsolatedKernel, fill_padding, run_case
from properties.strategies import attention_cases
from reference.case import AttentionCase, Mask

pytestmark = pytest.mark.cpu


def _case(mask: Mask | None = None, *, B: int = 2, Sq: int = 20, Sk: int = 37) -> AttentionCase:
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((B, S, 2, 16)).astype(np.float16) for S in (Sq, Sk, Sk))
    return AttentionCase(q, k, v, mask=mask or Mask())


PADDED = Mask(causal=True, q_lengths=(20, 5), k_lengths=(30, 0))


@pytest.mark.parametrize(
    ("bug", "check"),
    [
        ("skip_last_row", "unwritten"),
        ("oob_write", "output-guard"),
        ("read_padding", "padding-read"),
        ("empty_nan", "nonfinite"),
    ],
)
def test_each_defensive_check_catches_its_bug(bug: str, check: str) -> None:
    verdict = run_case(GuardedNumpyAdapter(bug), _case(PADDED), compare=False)
    assert [f.check for f in verdict.findings] == [check]
    with pytest.raises(CheckFailed, match=f"^{check}:"):
        verdict.raise_for(check)


def test_correct_guarded_kernel_passes_every_check() -> None:
    verdict = run_case(GuardedNumpyAdapter(), _case(PADDED))
    verdict.raise_for()
    expected = {"prefill", "output-guard", "padding-poison", "determinism", "bound", "lse"}
    assert expected <= verdict.applied


def test_declared_nan_empty_rows_are_translated_not_failed() -> None:
    adapter = GuardedNumpyAdapter("empty_nan")
    adapter.spec = dataclasses.replace(adapter.spec, empty_rows="nan")
    verdict = run_case(adapter, _case(PADDED))
    verdict.raise_for()
    assert any("empty rows gave NaN" in note for note in verdict.declared)
    assert np.isfinite(verdict.result.o).all()


def test_nondeterminism_is_caught() -> None:
    verdict = run_case(FaultyAdapter("flaky"), _case(), compare=False)
    assert verdict.failed("determinism")


def test_wrong_values_fail_the_bound_with_triage() -> None:
    class Perturbed(GuardedNumpyAdapter):
        def run_guarded(self, case, *, prefill):
            result, writes = super().run_guarded(case, prefill=prefill)
            result.o[0, 3, 1, 2] += 0.25
            return result, writes

    verdict = run_case(Perturbed(), _case(PADDED))
    with pytest.raises(CheckFailed, match="(?s)^bound:.*kernel implementation bug"):
        verdict.raise_for("bound")


def test_fill_padding_touches_only_padding() -> None:
    case = _case(PADDED)
    poisoned = fill_padding(case, np.nan)
    assert np.isnan(poisoned.k[1].astype(np.float32)).all()  # k_lengths[1] = 0
    np.testing.assert_array_equal(poisoned.k[0, :30], case.k[0, :30])
    assert np.isnan(poisoned.q[1, 5:].astype(np.float32)).all()


@pytest.mark.parametrize(
    ("fault", "check"), [("hang", "timeout"), ("exit", "crash"), ("raises", "error")]
)
def test_isolated_worker_reports_fault_saves_case_and_recovers(
    fault: str, check: str, tmp_path
) -> None:
    worker = IsolatedKernel(f"kernel.broken.cpu_faults:{fault}", timeout_s=3.0)
    try:
        verdict = run_case(
            FaultyAdapter(fault), _case(), isolated=worker, compare=False, finding_dir=tmp_path
        )
        assert [f.check for f in verdict.findings] == [check]
        saved = AttentionCase.load(verdict.findings[0].case_path)
        np.testing.assert_array_equal(saved.q, _case().q)
        # the next case gets a fresh worker: same finding again, not a dead session
        assert run_case(FaultyAdapter(fault), _case(), isolated=worker, compare=False).failed(check)
    finally:
        worker.close()


def test_isolated_worker_runs_a_healthy_kernel() -> None:
    worker = IsolatedKernel("streaming-fa", timeout_s=60.0)
    try:
        run_case(registry.resolve("streaming-fa"), _case(PADDED), isolated=worker).raise_for()
    finally:
        worker.close()


@settings(max_examples=15)
@given(case=attention_cases(spec=registry.resolve("streaming-fa").spec, max_len=80))
def test_cpu_virtual_kernel_passes_every_check(case: AttentionCase) -> None:
    run_case(registry.resolve("streaming-fa"), case, exact_rows=2).raise_for()


def test_registry_resolves_names_and_dotted_paths() -> None:
    assert registry.resolve("streaming-fa").spec.name == "streaming-fa"
    assert registry.resolve("kernel.broken.cpu_faults:guarded").spec.name == "cpu-guarded"
    instance = registry.resolve("kernel.broken.cpu_faults:GuardedNumpyAdapter")
    assert isinstance(instance, GuardedNumpyAdapter)
    assert registry.default_kernels(has_gpu=False) == ["streaming-fa"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-kernel", "built-in name"),
        ("kernel.no_module:thing", "cannot load"),
        ("kernel.registry:BUILTIN", "must be an adapter"),
    ],
)
def test_registry_rejects_bad_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.resolve(name)
