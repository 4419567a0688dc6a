"""The deliberately broken Triton kernels (testing/broken/triton_fa.py) on a GPU: each fails
exactly its named check of the harness, and the correct one passes."""

from __future__ import annotations

import numpy as np
import pytest

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.properties.kernels_under_test import worker
from attention_crossval.reference.case import AttentionCase, Mask

BROKEN = ("no_rescale", "oob_write", "skip_last_tile", "read_padding")


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


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BROKEN)
def test_broken_triton_kernel_is_caught_by_its_check(variant: str) -> None:
    """The deliberately broken kernel fails exactly its named check and no other; the correct one
    passes."""
    case = _TRIGGERS[variant]()
    broken = resolve(f"attention_crossval.testing.broken.triton_fa:{variant}")
    verdict = run_case(
        broken, case, isolated=worker(f"attention_crossval.testing.broken.triton_fa:{variant}")
    )
    assert {f.check for f in verdict.findings} == {broken.expected_check}, verdict.findings
    with pytest.raises(CheckFailed, match=f"^{broken.expected_check}:"):
        verdict.raise_for(broken.expected_check)
    baseline = run_case(
        resolve("attention_crossval.testing.broken.triton_fa:correct"),
        case,
        isolated=worker("attention_crossval.testing.broken.triton_fa:correct"),
    )
    baseline.raise_for()
