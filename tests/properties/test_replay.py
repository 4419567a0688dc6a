"""``replay`` reruns the kernel a case was saved for, on the pass it was saved for; failures of
the kernel suites print a compact summary whose ``reproduce:`` command is that replay; findings
name a likely cause where the error's shape points at one (``kernel.harness.cause_hints``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.kernel.harness.cause_hints import cause_hint
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.references import float64_reference
from attention_crossval.properties import replay
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.testing.broken.cpu_mistakes import MistakenAdapter

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
MISTAKES = "attention_crossval.testing.broken.cpu_mistakes"
BACKWARD_FAULTS = "attention_crossval.testing.broken.cpu_backward_faults"


def _causal_case(Sq: int = 6, Sk: int = 4) -> AttentionCase:
    """Bottom-right causal with Sq > Sk: the first rows are empty, the others see part of K."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, S, 2, 16)).astype(np.float16) for S in (Sq, Sk, Sk))
    return AttentionCase(q, k, v, mask=Mask(causal=True))


def _backward_case() -> BackwardCase:
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, S, 2, 16)).astype(np.float16) for S in (5, 9, 9, 5))
    return BackwardCase(AttentionCase(q, k, v, mask=Mask(causal=True)), do)


def _saved(case, tmp_path: Path, kernel: str) -> Path:
    """Save ``case`` for ``kernel`` as a failing test does, and return the note's path."""
    with (
        pytest.raises(AssertionError) as info,
        replay.reproducer_on_failure(case, tmp_path, kernel=kernel),
    ):
        raise AssertionError("a finding")
    (note,) = info.value.__notes__
    assert note.startswith("reproduce: python -m attention_crossval.properties.replay ")
    return Path(note.split()[-1])


def test_replay_reruns_the_saved_kernel_and_exits_1_while_it_fails(tmp_path, capsys) -> None:
    path = _saved(_causal_case(), tmp_path, f"{MISTAKES}:no_causal_mask")
    assert replay.saved_for(path) == ("forward", f"{MISTAKES}:no_causal_mask")
    assert replay.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert f"forward pass of kernel {MISTAKES}:no_causal_mask" in out
    assert "FAIL: empty-rows" in out and "mask?" in out
    assert replay.main([str(path), "--kernel", "streaming-fa"]) == 0  # --kernel overrides
    assert "PASS: every applied check passed" in capsys.readouterr().out
    assert replay.main([str(path), "--references-only"]) == 0  # the reference tiers only
    out = capsys.readouterr().out
    assert "streaming float64" in out and "kernel" not in out


def test_replay_of_a_backward_case_reruns_the_backward_pass(tmp_path, capsys) -> None:
    path = _saved(_backward_case(), tmp_path, f"{BACKWARD_FAULTS}:missing_d")
    assert replay.saved_for(path) == ("backward", f"{BACKWARD_FAULTS}:missing_d")
    assert replay.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "backward pass of kernel" in out and "FAIL: dq-bound" in out
    assert replay.main([str(path), "--references-only"]) == 0
    assert "reference tiers of the forward pass" in capsys.readouterr().out


def test_a_case_the_harness_saves_names_its_kernel(tmp_path, capsys) -> None:
    """``run_case(finding_dir=...)`` (the report's and benchmarks' saves) stores the worker's
    ``--kernel`` spelling too, so the saved case replays that kernel."""
    worker = IsolatedKernel(f"{MISTAKES}:no_causal_mask", timeout_s=60.0)
    try:
        verdict = run_case(worker, _causal_case(), exact_rows=1, finding_dir=tmp_path)
    finally:
        worker.close()
    path = Path(verdict.findings[0].case_path)
    assert replay.saved_for(path) == ("forward", f"{MISTAKES}:no_causal_mask")
    assert replay.main([str(path)]) == 1
    assert "FAIL: empty-rows" in capsys.readouterr().out


def test_replay_refuses_a_kernel_that_cannot_load(tmp_path, capsys) -> None:
    path = _saved(_causal_case(), tmp_path, f"{MISTAKES}:no_causal_mask")
    assert replay.main([str(path), "--kernel", "no_such_module.fa:create"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load no_such_module.fa:create" in err


def test_backward_cases_are_saved_at_most_cases_per_test(tmp_path) -> None:
    rng = np.random.default_rng(0)
    base = _backward_case()
    cases = [
        BackwardCase(base.forward, rng.standard_normal(base.do.shape).astype(np.float16))
        for _ in range(replay.CASES_PER_TEST + 3)
    ]
    paths = [replay.save_failing_case(c, tmp_path, test="backward", kernel="k") for c in cases]
    assert sorted(tmp_path.iterdir()) == sorted({*paths[: replay.CASES_PER_TEST - 1], paths[-1]})
    np.testing.assert_array_equal(BackwardCase.load(paths[-1]).do, cases[-1].do)


@pytest.mark.parametrize(
    ("mistake", "expected"), [("no_causal_mask", "mask? "), ("wrong_row_sum", "row sum? ")]
)
def test_findings_name_the_likely_cause(mistake: str, expected: str) -> None:
    verdict = run_case(MistakenAdapter(mistake), _causal_case(), exact_rows=1)
    assert verdict.findings
    for finding in verdict.findings:
        assert f"hint: {expected}" in finding.message, finding


def test_no_cause_is_named_for_other_errors() -> None:
    """An error with no such shape (noise on every element) and a correct result get none."""
    case = _causal_case()
    reference = float64_reference(case)
    assert cause_hint(case, reference) is None
    noise = np.random.default_rng(1).standard_normal(reference.o.shape) * 0.05
    assert cause_hint(case, AttentionResult(o=reference.o + noise, lse=reference.lse)) is None


def _pytest(*args: str, report_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HYPOTHESIS_PROFILE": "ci"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "cpu", *args]
    command += ["--report-dir", str(report_dir), "--hypothesis-seed", "0"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("suite", "kernel", "check"),
    [
        (
            "test_kernels.py::test_kernel_passes_every_check",
            f"{MISTAKES}:no_causal_mask",
            "empty-rows",
        ),
        (
            "test_kernels_backward.py::test_kernel_backward_passes_every_check",
            f"{BACKWARD_FAULTS}:missing_d",
            "dq-bound",
        ),
    ],
)
def test_a_suite_failure_is_compact_and_its_command_replays_it(
    tmp_path, suite: str, kernel: str, check: str
) -> None:
    """The kernel suite on a broken CPU kernel: a compact failure (no arrays), at most
    CASES_PER_TEST saved cases, and the printed command reruns the kernel and exits 1 naming
    the check."""
    done = _pytest(
        f"src/attention_crossval/properties/{suite}", "--kernel", kernel, report_dir=tmp_path
    )
    assert done.returncode == 1, done.stdout[-3000:]
    section = done.stdout.split(" FAILURES ")[1].split(" attention case coverage ")[0]
    # one block per failed test (the backward suite runs a test per strategy)
    failures = re.split(r"\n_+ test_\S+ _+\n", "\n" + section)[1:]
    assert failures, section
    for failure in failures:
        assert "array(" not in failure and len(failure.splitlines()) < 60, failure
    assert len(list(tmp_path.glob("*.npz"))) <= replay.CASES_PER_TEST * len(failures)
    command = re.search(r"reproduce: (python -m \S+ \S+)", failures[0]).group(1)
    argv = shlex.split(command)
    again = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"FAIL: {check}" in again.stdout


def test_backward_marker_selects_the_backward_modules_alone() -> None:
    """``-m backward`` keeps this package's backward test modules and drops the others."""
    files = [
        f"src/attention_crossval/properties/{name}"
        for name in ("test_exact_backward.py", "test_compare.py")
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"]
        + ["-m", "backward", *files],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith(files[0]) for line in collected), done.stdout
