"""The suite's wiring, end to end through pytest itself (pytester): markers, GPU skips, the
refusal of unmarked tests, and the strict-marker configuration from pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import attention_crossval

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "pyproject.toml").is_file():  # an installed copy: these tests need the checkout
    pytest.skip("needs the source checkout (pyproject.toml)", allow_module_level=True)
TESTS = """
import pytest

@pytest.mark.cpu
def test_on_cpu():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_on_gpu():
    import torch
    assert torch.cuda.is_available()
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A scratch project with this repository's pytest settings (the plugin they load importable
    from where this copy of the package lives, installed or not)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(attention_crossval.__file__).resolve().parents[1]))
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    settings = {k: v for k, v in options["ini_options"].items() if k != "testpaths"}
    lines = [f"{key} = {_ini_value(value)}" for key, value in settings.items()]
    pytester.makeini("[pytest]\n" + "\n".join(lines) + "\n")
    return pytester


def _ini_value(value: object) -> str:
    if isinstance(value, list):
        return "\n    " + "\n    ".join(str(item) for item in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_cpu_selection_runs_only_cpu_tests(project: pytest.Pytester) -> None:
    project.makepyfile(test_wiring=TESTS)
    result = project.runpytest_subprocess("-m", "cpu")
    result.assert_outcomes(passed=1, deselected=1)


def test_gpu_tests_skip_with_a_reason_without_cuda(project: pytest.Pytester) -> None:
    from attention_crossval.kernel.harness.gpu_workers import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA GPU is visible here: the gpu test would run instead of skipping")
    project.makepyfile(test_wiring=TESTS)
    result = project.runpytest_subprocess("-m", "gpu", "-rs")
    result.assert_outcomes(skipped=1, deselected=1)
    result.stdout.fnmatch_lines(["*gpu test skipped: *"])


def test_unmarked_tests_are_refused(project: pytest.Pytester) -> None:
    project.makepyfile(test_unmarked="def test_nothing_marked():\n    pass\n")
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*every test must be marked cpu or gpu*"])


def test_unknown_marker_is_an_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_typo="import pytest\n\n@pytest.mark.gpux\ndef test_x():\n    pass\n")
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # --strict-markers: collection error


def test_public_surface_has_what_an_adapter_author_needs() -> None:
    """Everything the adapter contract names is importable from ``attention_crossval`` itself."""
    import attention_crossval

    needed = {
        "KernelSpec", "KernelAdapter", "AttentionCase", "AttentionResult", "Mask",
        "CausalAlignment", "StreamingPrecision", "Declined", "KnownFinding",
        "BackwardCase", "Gradients", "BackwardPrecision", "BackwardKernelAdapter", "PublicCall",
    }  # fmt: skip
    assert needed <= set(attention_crossval.__all__)
    assert all(getattr(attention_crossval, name) is not None for name in needed)
