"""Acceptance: the package as a kernel developer gets it, used from their own repository.

The package is built and installed non-editable (``pip install --no-deps --target``) into a
temporary folder; pytester then works in another temporary folder, outside this checkout, that
looks like a kernel developer's repository: their kernel in a folder named ``kernel/`` (a common
name), a package with a broken kernel, and decoy ``report/``, ``reference/`` and ``properties/``
folders that raise if imported. The README's command must pass on the correct kernel and fail
on the broken one, with no CUDA; ``--report-dir``, the markers, ``--attention-profile`` and
``attention-report`` must work there.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jedi_imports import unresolved

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "pyproject.toml").is_file():  # an installed copy: these tests need the checkout
    pytest.skip("needs the source checkout (pyproject.toml)", allow_module_level=True)
NOT_SHIPPED = (".git", ".venv", ".hypothesis", ".tox", "build", "dist", "*.egg-info", "__pycache__")
NOT_SHIPPED += (".pytest_cache", ".ruff_cache", "attention-report-out", "reports")

# A user's kernel, on the public surface only: dense softmax in float64, O rounded to fp16.
USER_KERNEL = """
import numpy as np

from attention_crossval import AttentionCase, AttentionResult, KernelSpec


class DenseAttention:
    def __init__(self, causal_shift: int = 0) -> None:
        self.causal_shift = causal_shift  # 1: query i also sees the next key (a bug)
        self.spec = KernelSpec(
            name="dense-broken" if causal_shift else "dense",
            dtypes=frozenset({"float16"}),
            head_dims=frozenset({16}),
            mask_kinds=frozenset({"causal"}),
            tile_m=16,
            tile_n=16,
            device="cpu",
        )

    def __call__(self, case: AttentionCase) -> AttentionResult:
        group = case.Hq // case.Hkv
        q = case.q.astype(np.float64)
        k = np.repeat(case.k.astype(np.float64), group, axis=2)
        v = np.repeat(case.v.astype(np.float64), group, axis=2)
        s = np.einsum("bihd,bjhd->bhij", q, k) * case.softmax_scale
        if case.mask.causal:  # bottom-right: key j visible from query i iff j <= i + Sk - Sq
            i = np.arange(case.Sq)[:, None]
            j = np.arange(case.Sk)[None, :]
            s = np.where(j <= i + case.Sk - case.Sq + self.causal_shift, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        o = np.einsum("bhij,bjhd->bihd", p / np.where(l == 0, 1.0, l), v)
        with np.errstate(divide="ignore"):
            lse = np.log(l[..., 0]) + m[..., 0]
        return AttentionResult(o=o.astype(case.q.dtype).astype(np.float64), lse=lse)


def correct() -> DenseAttention:
    return DenseAttention()


def broken() -> DenseAttention:
    return DenseAttention(causal_shift=1)
"""
DECOY = "raise ImportError('decoy {name}/ imported: the tool must never import it')\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout built and installed non-editable into a fresh folder."""
    root = tmp_path_factory.mktemp("installed")
    source, target = root / "source", root / "site"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    # Without network access the build must use this environment's setuptools when it is
    # recent enough for pyproject.toml (>= 77), else pip fetches one (build isolation).
    setuptools = importlib.metadata.version("setuptools") if _has("setuptools") else "0"
    isolation = ["--no-build-isolation"] if int(setuptools.split(".")[0]) >= 77 else []
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation]
    done = subprocess.run(
        [*command, "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"pip install failed:\n{done.stderr[-3000:]}"
    return target


def _has(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def repository(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    """A user's repository (pytester's folder, outside this checkout, first on PYTHONPATH) with
    the installed package next on PYTHONPATH."""
    pytester.mkpydir("kernel").joinpath("fa.py").write_text(USER_KERNEL)
    pytester.mkpydir("userpkg").joinpath("fa.py").write_text(USER_KERNEL)
    for name in ("report", "reference", "properties"):
        pytester.mkdir(name).joinpath("__init__.py").write_text(DECOY.format(name=name))
    monkeypatch.setenv("PYTHONPATH", str(site))  # pytester puts its own folder first
    for name in (
        "CI",
        "HYPOTHESIS_PROFILE",
        "ATTENTION_CROSSVAL_PROFILE",
        "ATTENTION_REPORT_DIR",
        "ATTENTION_CROSSVAL_SEED",
    ):
        monkeypatch.delenv(name, raising=False)
    assert ROOT not in pytester.path.parents
    return pytester


def test_the_installed_copy_is_the_one_imported(repository: pytest.Pytester, site: Path) -> None:
    code = "import attention_crossval.kernel.harness.registry as m; print(m.__file__)"
    result = repository.run(sys.executable, "-c", code)
    assert result.ret == 0, result.stderr.str()
    assert Path(result.outlines[-1]).is_relative_to(site)


def test_go_to_definition_leads_into_the_installed_copy(site: Path) -> None:
    """Go-to-definition in an install: jedi, with only the install folder to search, follows
    every package import of the representative modules to the installed file."""
    looked_up, misses = unresolved(site / "attention_crossval", [site])
    assert looked_up >= 90, looked_up
    assert misses == []


def test_correct_kernel_passes_from_its_kernel_folder(repository: pytest.Pytester) -> None:
    """The README's command, on the user's correct CPU kernel in their own ``kernel/``: the
    free test, its 13 sweep pairs (every distribution but nonfinite_padding, causal) and its
    one feature (long decode: its spec declares no option, no varlen and no window)."""
    result = repository.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "attention_crossval.properties", "-m", "kernel",
        "--kernel", "kernel.fa:correct", "--attention-profile=ci",
    )  # fmt: skip
    assert _outcomes(result) == {"passed": 15}
    result.stdout.fnmatch_lines(
        ["attention-crossval profile: ci *", "attention-crossval seed: --hypothesis-seed=*"]
    )


def test_broken_kernel_fails_with_a_compact_summary(repository: pytest.Pytester) -> None:
    """Selected as a ``cpu`` (and not ``gpu``) kernel test, it fails with one summary: the check,
    the shrunk case, the replay command of the case saved under ``--report-dir``; no arrays."""
    reports = repository.path / "reports"
    result = repository.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "attention_crossval.properties",
        "-m", "kernel and cpu and not gpu", "-x", "--kernel", "userpkg.fa:broken",
        "--report-dir", reports,
    )  # fmt: skip
    assert _outcomes(result) == {"failed": 1}
    result.stdout.fnmatch_lines(
        [
            "E * kernel dense-broken, case B=* Sq=* Sk=* mask=causal*",
            f"E * reproduce: python -m attention_crossval.properties.replay {reports}/case-*.npz",
        ]
    )
    assert "array(" not in result.stdout.str()
    assert 1 <= len(list(reports.glob("*.npz"))) <= 5


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    """Passed, failed and errors of the run (the checkout-only modules skip: not counted)."""
    outcomes = result.parseoutcomes()
    return {k: outcomes[k] for k in ("passed", "failed", "errors") if outcomes.get(k)}


def test_report_runs_with_decoy_folders(repository: pytest.Pytester) -> None:
    out = repository.path / "report-out"
    result = repository.run(
        sys.executable, "-m", "attention_crossval.report", "--kernel", "kernel.fa:correct",
        "--sample", "2", "--rows", "2", "--no-html", "--no-progress", "--strict", "--out", out,
    )  # fmt: skip
    assert result.ret == 0, result.stderr.str()
    assert (out / "report.json").is_file()
