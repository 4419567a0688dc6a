"""CPU kernels with one deliberate fault each, to test the harness without a GPU.

Faults in the call (:class:`FaultyAdapter`): ``hang``, ``spin`` (a busy hang), ``exit``
(``os._exit``, as a CUDA fault kills a process), ``sys_exit`` (``sys.exit(0)``), ``segfault``,
``raises``, ``memory`` (``MemoryError``), ``flaky`` (nondeterministic), ``writes_inputs``
(negates q in place), ``wrong_shape`` (O with twice the Dv). Faults in the factory:
``factory_hangs``, ``factory_segfaults``, ``factory_exits``, ``factory_raises``, ``bad_spec`` (a
``spec`` that is not a KernelSpec); ``testing.broken.fails_at_import`` fails when imported. And a
NumPy "kernel" with guard-banded output buffers whose variants mirror the Triton ones
(``skip_last_row``, ``oob_write``, ``read_padding``, ``empty_nan``) plus ``empty_finite_lse`` (a
finite LSE on rows that see no key, where the convention is -inf: caught by ``empty-rows``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention

GUARD = 4
_GUARD_VALUE = -7.0e300  # a value no attention output can hold
_MASKED_SENTINEL = -1.0e30  # a finite "minus infinity" for masked scores, as kernels often use


def _spec(name: str, **overrides: object) -> KernelSpec:
    fields = {
        "dtypes": frozenset({"float16", "bfloat16", "float32"}),
        "head_dims": frozenset({8, 16, 32, 64}),
        "mask_kinds": frozenset({"causal", "window", "varlen", "explicit"}),
        "tile_m": 16,
        "tile_n": 16,
        "device": "cpu",
    }
    return KernelSpec(name=name, **{**fields, **overrides})


def _streaming(case: AttentionCase) -> AttentionResult:
    precision = StreamingPrecision.flash_attention(case.dtype)
    return streaming_attention(case, precision, block_m=16, block_n=16)


@dataclass
class FaultyAdapter:
    """``fault`` one of the module docstring's call faults; otherwise the streaming tier."""

    fault: str
    spec: KernelSpec = field(default_factory=lambda: _spec("cpu-fault"))

    def __call__(self, case: AttentionCase) -> AttentionResult:
        if self.fault == "hang":
            time.sleep(3600)
        if self.fault == "spin":  # a busy hang at 100% CPU; touches $CPU_FAULTS_MARKER first
            if os.environ.get("CPU_FAULTS_MARKER"):
                Path(os.environ["CPU_FAULTS_MARKER"]).touch()
            while True:
                pass
        if self.fault == "exit":
            os._exit(3)
        if self.fault == "sys_exit":
            sys.exit(0)
        if self.fault == "segfault":
            _segfault()
        if self.fault == "raises":
            raise RuntimeError("deliberate failure inside the kernel")
        if self.fault == "memory":
            raise MemoryError("deliberate: out of memory inside the kernel")
        result = _streaming(case)
        if self.fault == "flaky":
            noise = np.random.default_rng().integers(0, 2, result.o.shape) * np.spacing(result.o)
            noise[result.o == 0] = 0.0
            return AttentionResult(o=result.o + noise, lse=result.lse)
        if self.fault == "writes_inputs":  # through the raw pointer, as a native kernel would
            negated = np.ascontiguousarray(-case.q)
            ctypes.memmove(case.q.ctypes.data, negated.ctypes.data, negated.nbytes)
        if self.fault == "wrong_shape":
            return AttentionResult(o=np.concatenate([result.o, result.o], axis=-1), lse=result.lse)
        return result


def _segfault() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV


@dataclass
class GuardedNumpyAdapter:
    """The streaming tier writing into NaN/zero-prefilled, guard-banded NumPy buffers."""

    bug: str = "none"
    spec: KernelSpec = field(default_factory=lambda: _spec("cpu-guarded"))
    checks: frozenset[str] = frozenset(
        {"unwritten", "output-guard", "padding-read", "determinism", "nonfinite"}
    )

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return self.run_guarded(case, prefill="zero")[0]

    def run_guarded(
        self, case: AttentionCase, *, prefill: str
    ) -> tuple[AttentionResult, tuple[str, ...]]:
        result = _streaming(case)
        if self.bug == "read_padding":  # P = 0 times the padded V rows, as a tile that reads them
            for b in range(case.B):
                padded_v = case.v[b, case.k_length(b) :].astype(np.float64)
                result.o[b] += 0.0 * padded_v.sum()
        fill = np.nan if prefill == "nan" else 0.0
        buf = np.full((case.B, case.Sq + 2 * GUARD, case.Hq, case.Dv), _GUARD_VALUE)
        buf[:, GUARD : GUARD + case.Sq] = fill
        rows = case.Sq - (1 if self.bug == "skip_last_row" else 0)
        buf[:, GUARD : GUARD + rows] = result.o[:, :rows]
        if self.bug == "oob_write":
            buf[:, GUARD + case.Sq] = result.o[:, -1]
        o = buf[:, GUARD : GUARD + case.Sq]
        if self.bug == "empty_nan":
            o = np.where((result.lse == -np.inf).transpose(0, 2, 1)[..., None], np.nan, o)
        outside = np.concatenate([buf[:, :GUARD], buf[:, GUARD + case.Sq :]], axis=1)
        writes = () if (outside == _GUARD_VALUE).all() else ("o: guard band written",)
        lse = result.lse.copy()
        if self.bug == "empty_finite_lse":  # its finite masked-score sentinel as the LSE
            lse[lse == -np.inf] = _MASKED_SENTINEL
        lse[..., rows:] = np.nan if prefill == "nan" else 0.0
        return AttentionResult(o=o.copy(), lse=lse), writes


def hang() -> FaultyAdapter:
    return FaultyAdapter("hang")


def exit() -> FaultyAdapter:  # noqa: A001 - the fault's name
    return FaultyAdapter("exit")


def raises() -> FaultyAdapter:
    return FaultyAdapter("raises")


def sys_exit() -> FaultyAdapter:
    return FaultyAdapter("sys_exit")


def segfault() -> FaultyAdapter:
    return FaultyAdapter("segfault")


def memory() -> FaultyAdapter:
    return FaultyAdapter("memory")


def writes_inputs() -> FaultyAdapter:
    return FaultyAdapter("writes_inputs")


def wrong_shape() -> FaultyAdapter:
    return FaultyAdapter("wrong_shape")


def spin() -> FaultyAdapter:
    return FaultyAdapter("spin")


def factory_hangs() -> FaultyAdapter:
    time.sleep(3600)
    return FaultyAdapter("none")


def factory_segfaults() -> FaultyAdapter:
    _segfault()
    return FaultyAdapter("none")


def factory_exits() -> FaultyAdapter:
    sys.exit(0)


def factory_raises() -> FaultyAdapter:
    raise RuntimeError("deliberate failure in the factory")


class _BadSpec:
    """Adapter-shaped, but its ``spec`` is a dict, not a KernelSpec."""

    spec = {"device": "cpu"}

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return _streaming(case)


def bad_spec() -> _BadSpec:
    return _BadSpec()


def flaky() -> FaultyAdapter:
    return FaultyAdapter("flaky")


def guarded() -> GuardedNumpyAdapter:
    return GuardedNumpyAdapter()


def empty_finite_lse() -> GuardedNumpyAdapter:
    return GuardedNumpyAdapter("empty_finite_lse")
