"""A crashing or hanging kernel fails the kernel suite fast (``properties/fail_fast.py``), the
pytest route's ``--kernel-timeout``, Ctrl-C during a report, and a kernel's own
KeyboardInterrupt."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import attention_crossval
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.pytest_plugin import _kernel_timeout
from attention_crossval.reference.case import AttentionCase
from attention_crossval.testing.broken.cpu_exits import CALL_LOG_ENV

pytestmark = pytest.mark.cpu

EXITS = "attention_crossval.testing.broken.cpu_exits"
EXIT_IN_BACKWARD = "attention_crossval.testing.broken.cpu_backward_faults:exit_in_backward"
# Where ``attention_crossval`` imports from (the checkout, or site-packages): subprocesses get
# it on PYTHONPATH, so they import this copy however it was installed.
IMPORT_ROOT = str(Path(attention_crossval.__file__).resolve().parent.parent)


def _small_case() -> AttentionCase:
    rng = np.random.default_rng(0)
    return AttentionCase(*(rng.standard_normal((1, 4, 1, 8)).astype(np.float16) for _ in "qkv"))


def _environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (IMPORT_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_crash_and_hang_are_not_rerun_and_later_tests_fail_at_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel suite on a segfaulting and a hanging kernel (forward tests) and one that
    exits in its backward (the backward test): the first crash (and timeout) of a test is
    reported as drawn, with its saved case, and never re-run to shrink it; after two in the
    session, a kernel's remaining tests fail without calling it, naming the two."""
    log = pytester.path / "calls.log"
    monkeypatch.setenv("PYTHONPATH", _environment()["PYTHONPATH"])
    monkeypatch.setenv(CALL_LOG_ENV, str(log))
    monkeypatch.setenv("ATTENTION_REPORT_DIR", str(pytester.path / "cases"))
    pytester.makeconftest('pytest_plugins = ["attention_crossval.pytest_plugin"]\n')
    start = time.perf_counter()
    forward = "test_kernel_passes_every_check or test_kernel_feature_passes_every_check"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "attention_crossval.properties.test_kernels",
        "attention_crossval.properties.test_kernels_backward",
        "-m",
        "kernel",
        f"--kernel={EXITS}:segfault",
        f"--kernel={EXITS}:hang",
        f"--kernel={EXIT_IN_BACKWARD}",
        "--kernel-timeout=0.5",
        "-k",
        f"({forward}) and not exit_in_backward or backward_passes and exit_in_backward",
    )
    seconds = time.perf_counter() - start
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 7 and not outcomes.get("passed"), outcomes
    calls = log.read_text().split()
    assert sorted(calls) == ["hang", "hang", "segfault", "segfault"], calls
    text = result.stdout.str()
    assert text.count("crash: worker process died (killed by SIGSEGV)") >= 2
    assert "timeout: no answer within 0.5 s (hang); worker killed" in text
    assert "crash: worker process died (exit code 3)" in text  # the backward suite's test
    failures = text.split(" FAILURES ")[1].split(" short test summary info ")[0]
    # one per faulted test: two per kernel before its remaining tests fail at once (the
    # backward suite runs one test per strategy, so the exiting kernel faults two of them too)
    assert failures.count("reported as drawn, not shrunk") == 6
    assert "reproduce: python -m attention_crossval.properties.replay" in text
    assert f"{EXITS}:segfault crashed or hung 2 times in this session" in text
    assert f"{EXITS}:hang crashed or hung 2 times in this session" in text
    assert "During handling" not in text and "Traceback" not in text
    assert seconds < 120, f"{seconds:.0f} s"


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "1e6", "abc", ""])
def test_kernel_timeout_option_refuses_bad_values(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--kernel-timeout=.* must be a"):
        _kernel_timeout(text)


def test_kernel_timeout_option_reads_seconds() -> None:
    assert _kernel_timeout("0.5") == 0.5


def test_kernel_raising_keyboard_interrupt_is_named() -> None:
    """A kernel's own KeyboardInterrupt is an ``error`` finding saying so, not a ``crash``, and
    the worker answers the next call."""
    worker = IsolatedKernel(f"{EXITS}:interrupt", timeout_s=60.0)
    try:
        verdict = run_case(worker, _small_case(), compare=False)
        assert [f.check for f in verdict.findings] == ["error"], verdict.findings
        message = verdict.findings[0].message
        assert message.startswith("kernel raised KeyboardInterrupt: deliberate"), message
        assert run_case(worker, _small_case(), compare=False).findings[0].check == "error"
    finally:
        worker.close(kill=True)


def test_ctrl_c_ends_a_report_with_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT to the report's process group (what Ctrl-C in a terminal sends) while an isolated
    kernel spins: exit status 130 and one line on stderr, from the report and its worker, at
    once."""
    marker = tmp_path / "spinning"
    command = [sys.executable, "-m", "attention_crossval.report", "--out", str(tmp_path / "out")]
    command += ["--kernel", "attention_crossval.testing.broken.cpu_faults:spin"]
    command += ["--preset", "tiny", "--only", "none", "--no-progress"]
    process = subprocess.Popen(
        command,
        env=_environment(CPU_FAULTS_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), process.communicate(timeout=60)
        os.killpg(process.pid, signal.SIGINT)
        interrupted = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        seconds = time.monotonic() - interrupted
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr
    assert stderr.strip() == "attention-report: interrupted (Ctrl-C)", stderr
    # the busy worker is killed, not asked to stop (it would never read that: 10 s lost)
    assert seconds < 9, f"{seconds:.1f} s from Ctrl-C to exit"
