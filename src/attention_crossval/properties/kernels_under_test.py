"""The kernels under test (``--kernel``) for the kernel suites: which ones, their declarations,
their markers, and the adapters the harness calls.

A kernel other than an in-process built-in (``registry.IN_PROCESS``) is only ever touched
through its worker process (an ``IsolatedKernel`` is itself an adapter): its module, factory and
calls never run in pytest's process, so a kernel that crashes or hangs at import cannot take the
session down.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from attention_crossval.kernel.contract.spec import MASK_KINDS, KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.gpu_workers import cuda_available
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.registry import (
    BACKWARD_VARIANTS,
    BROKEN_FIXTURES,
    GPU_BUILTIN,
    IN_PROCESS,
    UNPROVEN,
    default_kernels,
    resolve,
)

_WORKERS: dict[str, IsolatedKernel] = {}


def worker(kernel: str) -> IsolatedKernel:
    """The kernel's worker, started on first use and shared by every test of the session (closed
    at its end, properties/conftest.py)."""
    if kernel not in _WORKERS:
        _WORKERS[kernel] = IsolatedKernel(kernel, timeout_s=300.0)
    return _WORKERS[kernel]


@pytest.fixture(scope="session", autouse=True)
def _kernel_workers() -> Iterator[None]:
    """The kernel suites' workers (:func:`worker`) live for the whole session, shared by every
    test module: a worker's start imports torch or CuTe DSL and sets up CUDA (seconds each), and
    a module that closed them made the next one start them again. Registered by the plugin;
    it closes only workers this package started."""
    yield
    close_workers()


def close_workers() -> None:
    for started in _WORKERS.values():
        started.close()
    _WORKERS.clear()


def kernel_adapter(kernel: str) -> KernelAdapter:
    """The ``--kernel`` under test: an in-process built-in resolved here, any other kernel its
    worker. A kernel that cannot load fails the test with one line."""
    try:
        if kernel in IN_PROCESS:
            return _resolved(kernel)
        started = worker(kernel)
        _ = started.spec  # the handshake: a factory that raises, exits, crashes or hangs fails here
        return started
    except ValueError as error:
        message = str(error)
    pytest.fail(f"--kernel: {message}", pytrace=False)  # outside the except: one line, no chain


@functools.cache
def _resolved(kernel: str) -> KernelAdapter:
    return resolve(kernel)


def kernel_spec(kernel: str) -> KernelSpec:
    """The declaration of a ``--kernel`` name: what parametrization needs (device, sweep). A
    GPU built-in without CUDA is not loaded (its package may be missing): it stands as a spec
    declaring every mask kind, so its tests are listed and skip with the reason."""
    if kernel in GPU_BUILTIN and not cuda_available()[0]:
        return KernelSpec(name=kernel, mask_kinds=MASK_KINDS, device="cuda")
    return kernel_adapter(kernel).spec


def chosen_kernels(config: pytest.Config, *, backward: bool = False) -> list[str]:
    """``--kernel``, else the GPU built-ins (all of them listed, skipped, without a GPU; the
    backward variants only for the backward suite) and, without a GPU, the CPU
    ``streaming-fa``."""
    chosen = config.getoption("--kernel")
    if chosen:
        return list(dict.fromkeys(chosen))
    listed = [
        n
        for n in GPU_BUILTIN
        if (backward or n not in BACKWARD_VARIANTS) and n not in UNPROVEN | BROKEN_FIXTURES
    ]
    gpus = default_kernels(has_gpu=True, backward=backward) or listed
    return gpus if cuda_available()[0] else [*gpus, *default_kernels(has_gpu=False)]


def device_mark(spec: KernelSpec) -> pytest.MarkDecorator:
    """``cpu`` or ``gpu`` by the kernel's declared device."""
    return pytest.mark.cpu if spec.device == "cpu" else pytest.mark.gpu


def kernel_param(kernel: str, *values: object, marks: tuple = (), id: str | None = None) -> object:
    """A parameter set for ``kernel``: the ``kernel`` marker, and ``cpu`` or ``gpu`` by its
    declared device (plus ``marks``)."""
    device = device_mark(kernel_spec(kernel))
    return pytest.param(kernel, *values, marks=[pytest.mark.kernel, device, *marks], id=id)
