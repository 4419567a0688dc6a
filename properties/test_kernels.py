"""GPU kernels against the references, under the defensive harness (kernel/harness.py).

Kernels come from ``--kernel`` (built-in name or ``package.module:attr``, repeatable); without
it, every built-in GPU adapter whose package is installed. Each kernel runs in its own worker
process, so a fault or hang is a finding for that case and the session goes on.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from attention_crossval.kernel.harness import CheckFailed, IsolatedKernel, run_case
from attention_crossval.kernel.registry import GPU_BUILTIN, default_kernels, resolve
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.reference.case import AttentionCase, Mask

pytestmark = pytest.mark.gpu

BROKEN = ("no_rescale", "oob_write", "skip_last_tile", "read_padding")
_WORKERS: dict[str, IsolatedKernel] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel" in metafunc.fixturenames:
        # Without a GPU every gpu test is skipped; list all built-ins so the skips show.
        chosen = metafunc.config.getoption("--kernel") or default_kernels(has_gpu=True)
        chosen = chosen or list(GPU_BUILTIN)
        metafunc.parametrize("kernel", chosen)


@pytest.fixture(scope="module", autouse=True)
def _close_workers():
    yield
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()


def _worker(kernel: str) -> IsolatedKernel:
    if kernel not in _WORKERS:
        _WORKERS[kernel] = IsolatedKernel(kernel, timeout_s=300.0)
    return _WORKERS[kernel]


@given(data=st.data())
def test_kernel_passes_every_check(
    kernel: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    """Every generated case inside the kernel's declaration passes every applicable check."""
    adapter = resolve(kernel)
    case = data.draw(
        attention_cases(spec=adapter.spec, max_len=4 * adapter.spec.tile_n + 1), label="case"
    )
    verdict = run_case(
        adapter,
        case,
        isolated=_worker(kernel),
        finding_dir=request.config.getoption("--report-dir"),
    )
    assume(verdict.skipped is None)  # declined by the kernel at run time (counted by the bench)
    verdict.raise_for()


def _ramp_case(
    Sq: int, Sk: int, *, k_lengths: tuple[int, ...] | None = None, B: int = 1
) -> AttentionCase:
    """Scores rising along the keys: every K block raises the running max (needs the rescale)."""
    rng = np.random.default_rng(7)
    D, H = 64, 2
    q = np.full((B, Sq, H, D), 0.25) + 0.01 * rng.standard_normal((B, Sq, H, D))
    ramp = np.linspace(0.0, 3.0, Sk)[None, :, None, None]
    k = ramp + 0.05 * rng.standard_normal((B, Sk, H, D))
    v = rng.standard_normal((B, Sk, H, D))
    mask = Mask(k_lengths=k_lengths) if k_lengths is not None else Mask()
    arrays = (np.asarray(a, dtype=np.float16) for a in (q, k, v))
    return AttentionCase(*arrays, mask=mask, label="ramp")


# Each bug with a case that exposes it: a ramp over several K blocks (rescale), Sq not a
# multiple of the 64-row tile (out-of-bounds stores, the last tile), keys past k_lengths.
_TRIGGERS = {
    "no_rescale": lambda: _ramp_case(65, 256),
    "oob_write": lambda: _ramp_case(100, 130),
    "skip_last_tile": lambda: _ramp_case(130, 70),
    "read_padding": lambda: _ramp_case(64, 160, k_lengths=(100, 37), B=2),
}


@pytest.mark.parametrize("variant", BROKEN)
def test_broken_triton_kernel_is_caught_by_its_check(variant: str) -> None:
    """The deliberately broken kernel fails exactly its named check and no other; the correct one
    passes."""
    case = _TRIGGERS[variant]()
    broken = resolve(f"attention_crossval.kernel.broken.triton_fa:{variant}")
    verdict = run_case(
        broken, case, isolated=_worker(f"attention_crossval.kernel.broken.triton_fa:{variant}")
    )
    assert {f.check for f in verdict.findings} == {broken.expected_check}, verdict.findings
    with pytest.raises(CheckFailed, match=f"^{broken.expected_check}:"):
        verdict.raise_for(broken.expected_check)
    baseline = run_case(
        resolve("attention_crossval.kernel.broken.triton_fa:correct"),
        case,
        isolated=_worker("attention_crossval.kernel.broken.triton_fa:correct"),
    )
    baseline.raise_for()
