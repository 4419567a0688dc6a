"""The defensive harness and the registry on CPU: every check fires on the fault it names.

The faulty kernels are in ``kernel/broken/cpu_faults.py``; the isolation tests spawn a real
worker process that hangs, exits or raises, and check the run goes on with a fresh worker.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings

from attention_crossval.kernel import registry
from attention_crossval.kernel.adapters import _torch, sdpa, streaming
from attention_crossval.kernel.broken.cpu_faults import FaultyAdapter, GuardedNumpyAdapter
from attention_crossval.kernel.harness import (
    ADAPTER_CHECKS,
    CheckFailed,
    IsolatedKernel,
    applied_checks,
    fill_padding,
    run_case,
)
from attention_crossval.kernel.references import output_dtype
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.precision import StreamingPrecision

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
    expected = {"unwritten", "output-guard", "padding-read", "determinism", "bound", "lse"}
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
    # the hang waits out its timeout; the others answer at once, 30 s only absorbs machine load
    timeout_s = 3.0 if fault == "hang" else 30.0
    worker = IsolatedKernel(
        f"attention_crossval.kernel.broken.cpu_faults:{fault}", timeout_s=timeout_s
    )
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


def slow_start() -> FaultyAdapter:
    """A kernel whose set-up (in the worker, before "ready") outlasts the call timeout."""
    time.sleep(8.0)
    return FaultyAdapter("none")


def test_call_timeout_excludes_the_worker_start() -> None:
    """Regression: spawn + imports + kernel set-up once counted against ``timeout_s``."""
    worker = IsolatedKernel("attention_crossval.properties.test_harness:slow_start", timeout_s=6.0)
    try:
        run_case(FaultyAdapter("none"), _case(), isolated=worker, compare=False).raise_for()
    finally:
        worker.close()


@pytest.mark.parametrize("field", ["timeout_s", "start_timeout_s"])
@pytest.mark.parametrize("value", [-1, 0, float("nan"), "5", True])
def test_isolated_kernel_rejects_bad_timeouts(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}=.* must be a number of seconds > 0"):
        IsolatedKernel("streaming-fa", **{field: value})


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
    assert (
        registry.resolve("attention_crossval.kernel.broken.cpu_faults:guarded").spec.name
        == "cpu-guarded"
    )
    instance = registry.resolve("attention_crossval.kernel.broken.cpu_faults:GuardedNumpyAdapter")
    assert isinstance(instance, GuardedNumpyAdapter)
    assert registry.default_kernels(has_gpu=False) == ["streaming-fa"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-kernel", "built-in name"),
        ("attention_crossval.kernel.no_module:thing", "cannot load"),
        ("attention_crossval.kernel.registry:BUILTIN", "must be an adapter"),
        ("os.path:join", "calling it raised TypeError"),
    ],
)
def test_registry_rejects_bad_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.resolve(name)


class _Scripted(GuardedNumpyAdapter):
    """The guarded kernel with ``edit(call_index, result)`` applied to each call's result."""

    def __init__(self, edit, **spec_changes) -> None:
        super().__init__()
        self.spec = dataclasses.replace(self.spec, **spec_changes)
        self.edit, self.calls = edit, 0

    def run_guarded(self, case, *, prefill):
        result, writes = super().run_guarded(case, prefill=prefill)
        self.edit(self.calls, result)
        self.calls += 1
        return result, writes


def _flip_zero_sign(call: int, result: AttentionResult) -> None:
    if call == 1:
        result.o[result.o == 0] = -0.0  # equal as values, different bits


def _nan_in_first_run_only(call: int, result: AttentionResult) -> None:
    if call == 0:
        result.o[0, 2, 1, 3] = np.nan


@pytest.mark.parametrize("edit", [_flip_zero_sign, _nan_in_first_run_only])
def test_determinism_compares_bits_both_ways(edit) -> None:
    """Regression: -0.0 vs 0.0 and NaN-in-A-only passed the value comparison."""
    adapter = _Scripted(edit)
    adapter.checks = frozenset({"determinism", "nonfinite"})  # no prefill check to hide behind
    verdict = run_case(adapter, _case(PADDED), compare=False)
    assert [f.check for f in verdict.findings] == ["determinism"]


def _padded_row_nonzero(call: int, result: AttentionResult) -> None:
    result.o[1, 10] = 1.0  # batch 1 has q_lengths 5: row 10 is a padded query row


@pytest.mark.parametrize(("padded_rows", "checks"), [("zero", ["empty-rows"]), ("unwritten", [])])
def test_padded_rows_declared_zero_are_checked(padded_rows: str, checks: list[str]) -> None:
    """Regression: padded query rows of a padded_rows="zero" kernel were never checked."""
    adapter = _Scripted(_padded_row_nonzero, padded_rows=padded_rows)
    verdict = run_case(adapter, _case(PADDED), compare=False)
    assert [f.check for f in verdict.findings] == checks


@pytest.mark.parametrize(("returns_lse", "checks"), [(True, ["lse"]), (False, [])])
def test_declared_lse_must_be_returned(returns_lse: bool, checks: list[str]) -> None:
    """Regression: a kernel declaring an LSE but returning none skipped every LSE check."""

    def drop_lse(call: int, result: AttentionResult) -> None:
        object.__setattr__(result, "lse", None)

    adapter = _Scripted(drop_lse, returns_lse=returns_lse)
    verdict = run_case(adapter, _case(PADDED))
    assert [f.check for f in verdict.findings] == checks


def test_bound_ulps_are_in_the_declared_chains_output_dtype() -> None:
    """Regression: the harness measured ulps in the input dtype, the report in the chain's
    output dtype; both now use kernel.references.output_dtype (accumulator when None)."""
    chain = StreamingPrecision.float64()
    adapter = _Scripted(
        lambda call, result: result.o.__setitem__((0, 3, 1, 2), result.o[0, 3, 1, 2] + 0.25),
        precision={"float16": chain},
    )
    assert output_dtype(adapter.spec, "float16") == "float64"
    verdict = run_case(adapter, _case(PADDED))
    with pytest.raises(CheckFailed, match=r"ulp \(float64\)"):
        verdict.raise_for("bound")


def test_saved_case_name_is_the_same_in_every_process(tmp_path) -> None:
    """Regression: the file name used hash(), salted per process."""
    script = (
        "import sys; from properties.test_harness import _case, PADDED; "
        "from kernel.harness import _save; print(_save(_case(PADDED), 'k', 'bound', sys.argv[1]))"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)],
            env=os.environ | {"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(names) == 1


def test_adapters_declare_checks_in_the_one_vocabulary() -> None:
    """Adapter ``checks`` name harness checks; the old capability names are refused."""
    declared = [
        _torch.GUARDED_CHECKS,
        sdpa.SdpaAdapter.checks,
        streaming.StreamingAdapter.checks,
        GuardedNumpyAdapter.checks,
    ]
    assert all(checks <= ADAPTER_CHECKS for checks in declared)
    adapter = GuardedNumpyAdapter()
    adapter.checks = frozenset({"prefill", "padding-poison"})
    with pytest.raises(ValueError, match=r"checks has \['padding-poison', 'prefill'\]"):
        applied_checks(adapter)
