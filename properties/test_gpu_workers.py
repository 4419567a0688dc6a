"""kernel.gpu_workers: each xdist worker gets one GPU, round robin, before torch sees others."""

from __future__ import annotations

import pytest

from attention_crossval.kernel.gpu_workers import gpu_for_worker

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("worker", "gpus", "expected"),
    [
        ("gw0", ["0", "1"], "0"),
        ("gw1", ["0", "1"], "1"),
        ("gw2", ["0", "1"], "0"),
        ("gw3", ["4", "6", "7"], "4"),
        ("master", ["0"], None),
        ("gw0", [], None),
    ],
)
def test_round_robin_assignment(worker: str, gpus: list[str], expected: str | None) -> None:
    assert gpu_for_worker(worker, gpus) == expected


def test_each_xdist_worker_sees_one_gpu(pytester: pytest.Pytester, monkeypatch) -> None:
    """End to end through xdist: two workers over declared GPUs 5,7 each see exactly one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    pytester.makeconftest('pytest_plugins = ["attention_crossval.kernel.gpu_workers"]')
    pytester.makepyfile(
        """
        import os, pytest
        @pytest.mark.parametrize("n", range(8))
        def test_pinned(n, worker_id):
            expected = {"gw0": "5", "gw1": "7"}[worker_id]
            assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "-q")
    result.assert_outcomes(passed=8)
