"""The defensive harness and the registry on CPU: every check fires on the fault it names.

The faulty kernels are in ``testing/broken/cpu_faults.py``; the isolation tests spawn a real
worker process that hangs, exits or raises, and check the run goes on with a fresh worker.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from attention_crossval.kernel.adapters import _torch, sdpa, streaming
from attention_crossval.kernel.contract.checks import ADAPTER_CHECKS
from attention_crossval.kernel.harness import isolation, registry
from attention_crossval.kernel.harness.execution import applied_checks
from attention_crossval.kernel.harness.forward import fill_padding, run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.references import output_dtype
from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.testing.broken.cpu_faults import FaultyAdapter, GuardedNumpyAdapter

pytestmark = pytest.mark.cpu

FAULTS = "attention_crossval.testing.broken.cpu_faults"


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
        ("empty_finite_lse", "empty-rows"),  # escaped when |got - -inf| <= inf passed any got
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
    ("fault", "check"),
    [
        ("hang", "timeout"),
        ("exit", "crash"),
        ("sys_exit", "crash"),
        ("segfault", "crash"),
        ("raises", "error"),
    ],
)
def test_isolated_worker_reports_fault_saves_case_and_recovers(
    fault: str, check: str, tmp_path
) -> None:
    # the hang waits out its timeout; the others answer at once, 30 s only absorbs machine load
    timeout_s = 3.0 if fault == "hang" else 30.0
    worker = IsolatedKernel(
        f"attention_crossval.testing.broken.cpu_faults:{fault}", timeout_s=timeout_s
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
    worker = IsolatedKernel("tests.kernel.harness.test_harness:slow_start", timeout_s=6.0)
    try:
        run_case(FaultyAdapter("none"), _case(), isolated=worker, compare=False).raise_for()
    finally:
        worker.close()


def test_a_launched_worker_starts_while_the_caller_works() -> None:
    """``launch`` returns before the slow set-up ends (the report builds the case meanwhile);
    the first call then waits for the handshake, and the call timeout still excludes it."""
    worker = IsolatedKernel("tests.kernel.harness.test_harness:slow_start", timeout_s=6.0)
    try:
        began = time.perf_counter()
        worker.launch()
        worker.launch()  # idempotent: one worker
        assert time.perf_counter() - began < 4.0 and worker._process.is_alive()
        first = worker._process.pid
        time.sleep(3.0)  # the caller's own work, overlapping the 8 s set-up
        run_case(FaultyAdapter("none"), _case(), isolated=worker, compare=False).raise_for()
        assert worker._process.pid == first and worker.spec.name == "cpu-fault"
        worker.start()  # a started worker is left as it is
        assert worker._process.pid == first
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
        registry.resolve("attention_crossval.testing.broken.cpu_faults:guarded").spec.name
        == "cpu-guarded"
    )
    instance = registry.resolve("attention_crossval.testing.broken.cpu_faults:GuardedNumpyAdapter")
    assert isinstance(instance, GuardedNumpyAdapter)
    assert registry.default_kernels(has_gpu=False) == ["streaming-fa"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-kernel", "built-in name"),
        ("pkg.mod:", "built-in name"),
        ("attention_crossval.kernel.no_module:thing", "cannot load"),
        ("attention_crossval.kernel.harness.registry:BUILTIN", "must be an adapter"),
        ("os.path:join", "calling it raised TypeError"),
        ("attention_crossval.testing.broken.fails_at_import:x", "cannot load.*ZeroDivisionError"),
        (f"{FAULTS}:bad_spec", "spec must be a KernelSpec, got dict"),
    ],
)
def test_registry_rejects_bad_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.resolve(name)


# --- faults of the kernel, its factory and its module (issue 9, section 5) ---------------------


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("factory_raises", "calling it raised RuntimeError: deliberate failure in the factory"),
        ("factory_exits", "set-up raised SystemExit: 0"),
        ("factory_segfaults", "worker process died \\(killed by SIGSEGV\\)"),
        ("bad_spec", "spec must be a KernelSpec, got dict"),
    ],
)
def test_factory_faults_in_the_worker_are_value_errors(factory: str, message: str) -> None:
    """Regression: the factory ran in the parent, so a crashing one ended the run."""
    with pytest.raises(ValueError, match=f"^kernel='{FAULTS}:{factory}': .*{message}"):
        isolation.describe(f"{FAULTS}:{factory}", start_timeout_s=60.0)


def test_hanging_factory_is_a_start_timeout() -> None:
    """Regression: a factory that never returned hung the run before any config started. (A
    start slower than 3 s under load gives the same answer: the factory never returns.)"""
    with pytest.raises(ValueError, match=r"no answer within 3 s \(worker start"):
        isolation.describe(f"{FAULTS}:factory_hangs", start_timeout_s=3.0)


def test_describe_learns_the_spec_without_importing_the_kernel_here(tmp_path, monkeypatch) -> None:
    """The parent learns the declaration from the worker's handshake: the user's module is
    imported only there (it would run user code here, where a fault ends the run)."""
    (tmp_path / "user_kernel_9.py").write_text(
        "from attention_crossval.testing.broken.cpu_faults import guarded as create\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = isolation.describe("user_kernel_9:create", start_timeout_s=60.0)
    assert spec == GuardedNumpyAdapter().spec
    assert "user_kernel_9" not in sys.modules
    assert isolation.describe("streaming-fa").device == "cpu"  # in process: a built-in opt-in


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
def test_kernel_writing_its_inputs_is_caught(isolated: bool) -> None:
    """Regression: under isolation the worker's unpickled inputs were never compared."""
    worker = IsolatedKernel(f"{FAULTS}:writes_inputs", timeout_s=30.0) if isolated else None
    try:
        verdict = run_case(FaultyAdapter("writes_inputs"), _case(), isolated=worker)
    finally:
        if worker is not None:
            worker.close()
    assert [f.check for f in verdict.findings] == ["input-write"]
    assert "q: 1280 elements written" in verdict.findings[0].message


def test_output_of_the_wrong_shape_is_a_finding() -> None:
    """Regression: an O of the wrong shape raised deep in the checks and aborted the report."""
    verdict = run_case(FaultyAdapter("wrong_shape"), _case())
    assert [f.check for f in verdict.findings] == ["shape"]
    assert verdict.findings[0].message == "o has shape [2, 20, 2, 32], expected [2, 20, 2, 16]"
    assert verdict.result is None


def test_memory_error_replaces_the_worker() -> None:
    """Regression: after a MemoryError every later call in the same worker failed too."""
    worker = IsolatedKernel(f"{FAULTS}:memory", timeout_s=30.0)
    try:
        worker.start()
        first = worker._process.pid
        assert run_case(worker, _case(), compare=False).failed("error")
        assert worker._process is None  # replaced: the next call starts a fresh one
        worker.start()
        assert worker._process.pid != first
    finally:
        worker.close()


def _children(pid: int) -> set[int]:
    tasks = Path(f"/proc/{pid}/task")
    text = " ".join((task / "children").read_text() for task in tasks.iterdir())
    return {int(child) for child in text.split()}


def _alive(pid: int) -> bool:
    """Running and not a zombie (a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_worker_dies_with_a_killed_report(tmp_path, signal_name: str) -> None:
    """Regression: SIGKILL/SIGTERM to attention-report left its busy worker running."""
    argv = ["--kernel", f"{FAULTS}:spin", "--preset", "tiny", "--only", "none", "--no-progress"]
    marker = tmp_path / "spinning"
    report = subprocess.Popen(
        [sys.executable, "-m", "attention_crossval.report", *argv, "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"CPU_FAULTS_MARKER": str(marker)},
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the kernel did not start spinning within 60 s"
        workers = _children(report.pid)
        assert workers
        report.send_signal(getattr(signal, signal_name))
        report.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers)
    finally:
        report.kill()
        report.wait()


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
        "import sys; import numpy as np; "
        "from attention_crossval.kernel.harness.forward import _save; "
        "from attention_crossval.reference.case import AttentionCase, Mask; "
        "rng = np.random.default_rng(3); "
        "q, k, v = (rng.standard_normal((2, S, 2, 16)).astype(np.float16) for S in (20, 37, 37)); "
        "mask = Mask(causal=True, q_lengths=(20, 5), k_lengths=(30, 0)); "
        "print(_save(AttentionCase(q, k, v, mask=mask), 'k', 'bound', sys.argv[1]))"
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
