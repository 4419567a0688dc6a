"""What the harness's input path costs for a big tensor: build, finite check, transfer to an
isolated worker (mapped file vs the pipe's pickle), the worker's input-write watch.

Run: ``python benchmarks/bench_huge_inputs.py [--keys N]`` (default: the ``gpu-huge`` decode at
1/8 of its keys, K and V of 2^28 + 2^14 elements, 512 MiB each in bf16: just above the old
budget, so the inputs are drawn as gpu-huge's are). Prints seconds and
the peak of memory NumPy allocated (tracemalloc) per step; the mapped file's pages are not
counted there (they are the file's: /dev/shm or the page cache). docs/long-context.md#huge
quotes a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from attention_crossval.kernel.harness import mapped
from attention_crossval.kernel.harness.execution import input_arrays, watch_inputs
from attention_crossval.kernel.harness.forward import fill_padding
from attention_crossval.reference.case import ELEMENTS_ENV, AttentionResult
from attention_crossval.report.configs import HUGE_KEYS, preset


def _step(name: str, work: Callable[[], Any]) -> Any:
    tracemalloc.start()
    start = time.perf_counter()
    value = work()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{name:44} {seconds:7.2f} s   peak {peak / 2**30:6.2f} GiB")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=HUGE_KEYS // 8)
    args = parser.parse_args()
    os.environ.setdefault(ELEMENTS_ENV, "2**33")
    (huge,) = preset("gpu-huge")
    config = dataclasses.replace(huge, Sk=args.keys, name="")
    elements = args.keys * config.Hkv * config.D
    print(f"K, V: {elements} elements each ({elements * 2 / 2**30:.2f} GiB bf16)")
    case = _step("build (draw, round, finite check)", config.build)
    _step("fill_padding (no padding: the case itself)", lambda: fill_padding(case, float("nan")))
    _step("pipe: pickle.dumps + loads (before)", lambda: pickle.loads(pickle.dumps(case, 5)))
    shipped = _step("mapped: write the file (parent, once a case)", lambda: mapped.map_out(case))
    try:
        twins = _step(
            "mapped: load both views (worker, each call)",
            lambda: (shipped.load(writable=True), shipped.load(writable=False)),
        )
        result = AttentionResult(o=case.q.astype(float), lse=None)
        _step(
            "watch: compare with the read-only mapping",
            lambda: watch_inputs(
                input_arrays(twins[0]),
                lambda: (result, ()),
                AttentionResult,
                input_arrays(twins[1]),
            ),
        )
        _step(
            "watch: copy, then compare (before)",
            lambda: watch_inputs(input_arrays(twins[0]), lambda: (result, ()), AttentionResult),
        )
    finally:
        mapped.remove(shipped)


if __name__ == "__main__":
    main()
