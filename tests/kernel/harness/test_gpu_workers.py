"""kernel.harness.gpu_workers: each xdist worker gets one GPU, round robin, before torch sees
others.
That a user's own xdist session keeps its devices is shown in test_plugin_guest."""

from __future__ import annotations

import os

import pytest

from attention_crossval.kernel.harness.gpu_workers import gpu_for_worker, pin_worker_gpu

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


class _Config:
    def __init__(self, workerinput: dict[str, str] | None) -> None:
        if workerinput is not None:
            self.workerinput = workerinput


def test_pin_worker_gpu_makes_the_assigned_gpu_the_only_one(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    pin_worker_gpu(_Config({"workerid": "gw1"}))  # no assignment: nothing changes
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    pin_worker_gpu(_Config(None))  # not an xdist worker
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    pin_worker_gpu(_Config({"workerid": "gw1", "attention_gpu": "7"}))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


@pytest.mark.parametrize("initialized", [True, False])
def test_an_idle_kernel_worker_returns_torchs_cached_device_memory(
    monkeypatch: pytest.MonkeyPatch, initialized: bool
) -> None:
    """Between calls a worker empties torch's CUDA cache, where CUDA is up (it never starts
    CUDA for that) and where torch is loaded at all."""
    import sys
    from types import SimpleNamespace

    from attention_crossval.kernel.harness.isolation import release_device_memory

    emptied: list[int] = []
    cuda = SimpleNamespace(
        is_initialized=lambda: initialized, empty_cache=lambda: emptied.append(1)
    )
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    release_device_memory()
    assert emptied == ([1] if initialized else [])
    monkeypatch.delitem(sys.modules, "torch")
    release_device_memory()  # no torch: nothing to do, and nothing imported
    assert "torch" not in sys.modules
