"""One kernel call in this process, as the harness and the isolated worker both make it: the
adapter's declared checks, the guarded call, and the inputs watched for writes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from attention_crossval.kernel.contract.checks import ADAPTER_CHECKS, BASIC_CHECKS
from attention_crossval.kernel.contract.spec import KernelAdapter
from attention_crossval.kernel.harness.phases import phase
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import BackwardCase, Gradients


class KernelCrashed(Exception):
    """The isolated kernel failed: ``check`` is "error", "crash" or "timeout"."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


class Run(NamedTuple):
    """One kernel call: its result, the guard bands it wrote (``output-guard``), and the inputs
    it changed (``input-write``), each as messages."""

    result: AttentionResult | Gradients
    writes: tuple[str, ...] = ()
    input_writes: tuple[str, ...] = ()


def execute(
    adapter: KernelAdapter, case: AttentionCase, prefill: str, clean: AttentionCase | None = None
) -> Run:
    """One forward call: through ``run_guarded`` when the adapter has it, else ``adapter(case)``,
    under :func:`watch_inputs` (``clean``: a read-only twin of ``case`` to compare with)."""

    def call() -> tuple[Any, Any]:
        if hasattr(adapter, "run_guarded"):
            return adapter.run_guarded(case, prefill=prefill)
        return adapter(case), ()

    before = None if clean is None else input_arrays(clean)
    return watch_inputs(input_arrays(case), call, AttentionResult, before)


def applied_checks(adapter: KernelAdapter) -> frozenset[str]:
    """The adapter-dependent checks it supports (``adapter.checks``, else the basic ones)."""
    checks = frozenset(getattr(adapter, "checks", BASIC_CHECKS))
    unknown = checks - ADAPTER_CHECKS
    if unknown:
        raise ValueError(
            f"{type(adapter).__name__}.checks has {sorted(unknown)}: must be a subset of "
            f"{sorted(ADAPTER_CHECKS)} (the others always apply)"
        )
    return checks


def backward_checks(adapter: KernelAdapter) -> frozenset[str]:
    """The adapter-dependent checks its backward supports (``adapter.backward_checks``, else
    determinism and finiteness); the same vocabulary as the forward's ``checks``."""
    checks = frozenset(getattr(adapter, "backward_checks", BASIC_CHECKS))
    unknown = checks - ADAPTER_CHECKS
    if unknown:
        raise ValueError(
            f"{type(adapter).__name__}.backward_checks has {sorted(unknown)}: must be a subset "
            f"of {sorted(ADAPTER_CHECKS)} (the others always apply)"
        )
    return checks


def execute_backward(
    adapter: Any, case: BackwardCase, prefill: str, clean: BackwardCase | None = None
) -> Run:
    """One backward call: ``run_backward_guarded`` when the adapter has it, else ``backward``,
    with its inputs (q, k, v, mask, dO) watched for writes (against ``clean``, a read-only twin
    of ``case``, when given)."""

    def call() -> tuple[Any, Any]:
        with np.errstate(all="ignore"):  # a kernel's overflow is judged by its output, not warned
            if hasattr(adapter, "run_backward_guarded"):
                return adapter.run_backward_guarded(case, prefill=prefill)
            return adapter.backward(case), ()

    def inputs(of: BackwardCase) -> dict:
        return {**input_arrays(of.forward), "do": of.do}

    return watch_inputs(inputs(case), call, Gradients, None if clean is None else inputs(clean))


def private_copy(case: AttentionCase | BackwardCase) -> AttentionCase | BackwardCase:
    """``case`` with arrays of its own, as a worker gets: a kernel in this process writing
    through a raw pointer cannot reach the caller's case (the references are computed from it)."""
    if isinstance(case, BackwardCase):
        return dataclasses.replace(case, forward=private_copy(case.forward))  # dO: copied there

    def copy(array: np.ndarray) -> np.ndarray:
        array = np.array(array)
        array.setflags(write=False)  # owned and read-only: the case takes it without a copy
        return array

    return dataclasses.replace(case, **{name: copy(getattr(case, name)) for name in "qkv"})


def watch_inputs(
    inputs: dict[str, np.ndarray],
    call: Callable[[], tuple[Any, Any]],
    returns: type,
    before: dict[str, np.ndarray] | None = None,
) -> Run:
    """``call()`` -> (result, guard-band writes), with ``inputs`` compared bitwise before and
    after, so a kernel writing into its inputs is caught wherever it runs (a worker's unpickled
    arrays are writeable); TypeError unless the result is a ``returns``. ``before``: the
    inputs' bits as the caller holds them apart from the kernel's copy (a worker's read-only
    mapping, :mod:`kernel.harness.mapped`), else a copy is taken."""
    if before is None:
        before = {name: array.copy() for name, array in inputs.items()}
    with phase("kernel"):
        result, writes = call()
    if not isinstance(result, returns):
        raise TypeError(f"the kernel returned {type(result).__name__}, not {returns.__name__}")
    changed = tuple(
        message
        for name, array in inputs.items()
        if (message := _changed(name, before[name], array)) is not None
    )
    return Run(result, tuple(writes), changed)


def input_arrays(case: AttentionCase) -> dict[str, np.ndarray]:
    inputs = {"q": case.q, "k": case.k, "v": case.v}
    if case.mask.explicit is not None:
        inputs["mask.explicit"] = case.mask.explicit
    return inputs


def _changed(name: str, before: np.ndarray, after: np.ndarray) -> str | None:
    """Where ``after`` differs from ``before`` in any bit (NaN payloads and -0.0 included)."""
    unsigned = f"u{before.dtype.itemsize}"
    differ = before.view(unsigned) != np.ascontiguousarray(after).view(unsigned)
    if not differ.any():
        return None
    index = tuple(int(i) for i in np.argwhere(differ)[0])
    return f"{name}: {int(differ.sum())} elements written by the kernel; first at {list(index)}"
