"""pytest-xdist plugin: pin each worker to one GPU, so ``pytest -m gpu -n N`` uses N GPUs.

The controller lists the GPUs it may use (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``)
without initialising CUDA, and hands worker ``gwK`` the K-th of them (round robin) through
xdist's ``workerinput``. The worker sets ``CUDA_VISIBLE_DEVICES`` (:func:`pin_worker_gpu`)
once its collection holds this package's GPU tests and before CUDA is first probed, so each
process sees exactly one device as ``cuda:0``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

_WORKER_GPU_KEY = "attention_gpu"


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without creating a CUDA context."""
    declared = os.environ.get("CUDA_VISIBLE_DEVICES")
    if declared is not None:
        return [gpu.strip() for gpu in declared.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return [str(index) for index, line in enumerate(listing.splitlines()) if line.startswith("GPU")]


def cuda_available() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, and the device name or the reason it does not."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed (pip install -e '.[gpu]')"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
    return True, torch.cuda.get_device_name()


def gpu_for_worker(worker_id: str, gpus: list[str]) -> str | None:
    """Round-robin assignment: worker ``gwK`` gets ``gpus[K % len(gpus)]``."""
    if not gpus or not worker_id.startswith("gw"):
        return None
    return gpus[int(worker_id[2:]) % len(gpus)]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # xdist controller hook, one call per worker
    gpu = gpu_for_worker(node.workerinput["workerid"], visible_gpus())
    if gpu is not None:
        node.workerinput[_WORKER_GPU_KEY] = gpu


def pin_worker_gpu(config: pytest.Config) -> None:
    """In an xdist worker given a GPU, make it the only visible one (before CUDA is probed).
    Called by the package's plugin only when its GPU tests were collected, so a user's own
    ``pytest -n`` session without them keeps its devices."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput and _WORKER_GPU_KEY in workerinput:
        os.environ["CUDA_VISIBLE_DEVICES"] = workerinput[_WORKER_GPU_KEY]


def worker_gpus_line(config: pytest.Config) -> str | None:
    """How xdist workers share the GPUs, for the run's header (None without xdist)."""
    workers = getattr(config.option, "numprocesses", None)
    if not workers:
        return None
    gpus = visible_gpus() or "none"
    return f"gpu workers: {workers} xdist workers over GPUs {gpus} (round robin)"
