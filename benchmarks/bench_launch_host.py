"""Host time per call of the own SM90 launch's Python part, on the CPU, the compiled function
stubbed.

Run from the repository root: ``PYTHONPATH=src python -m benchmarks.bench_launch_host``
(``--calls N --repeats R``). It times ``own_sm90.launch`` (the dense path, the adapters'
``DEFAULT_KNOBS``) and ``own_sm90.launch_full`` (the varlen path) at 16 x 16 x 1024 x 128
causal bf16 on CPU torch tensors, with kernel/adapters/_cute.py's compile replaced by a
recorder: what is measured is all the work a call does in Python before the compiled
function (TVM-FFI's argument checks and the launch itself, in C++, are not: they need a GPU).
It prints the fastest and the median of ``--repeats`` runs of ``--calls`` calls, in
microseconds of CPU time per call (:func:`per_call_us`), and checks that the recorder got the
caller's tensor objects themselves, unwrapped, with every parameter of the kernel filled.
Needs torch (CPU is enough), not cutlass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """The fastest and the median of ``repeats`` runs of ``calls`` calls of ``fn``, in
    microseconds of this process's CPU time per call (CPU time rather than wall time: on a
    shared machine another process's load stretches the wall clock, not the work done)."""
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - start) / calls * 1e6)
    return min(runs), statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per run")
    parser.add_argument("--repeats", type=int, default=7, help="runs; the median is printed")
    args = parser.parse_args(argv)

    import torch

    from attention_crossval.kernel.adapters import _cute, own_sm90

    received: list[tuple] = []
    _cute.compiled = lambda key, make_kernel: (lambda *a: received.append(a), (None,) * 11)
    B, H, S, D = 16, 16, 1024, 128
    q, k, v, out = (torch.empty(B, S, H, D, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(B, H, S)
    lengths = torch.full((B,), S, dtype=torch.int32)
    knobs = dict.fromkeys(own_sm90.DEFAULT_KNOBS, True)
    paths = {
        "launch (dense path)": lambda: own_sm90.launch(
            q, k, v, out, lse, D**-0.5, causal=True, **knobs
        ),
        "launch_full (varlen path)": lambda: own_sm90.launch_full(
            q, k, v, out, lse, D**-0.5, True, lengths, lengths, None, **knobs
        ),
    }
    print(f"torch {torch.__version__}; {B}x{H}x{S}x{D} causal bf16, DEFAULT_KNOBS")
    for name, fn in paths.items():
        received.clear()
        fastest, median = per_call_us(fn, args.calls, args.repeats)
        first, tensors = received[0], (q, k, v, out, lse)
        if len(first) != 11 or any(a is not b for a, b in zip(first, tensors, strict=False)):
            raise SystemExit(f"{name}: the compiled function got {first!r}, not the tensors")
        print(
            f"{name}: {fastest:.2f} us per call before the compiled function (median {median:.2f})"
        )


if __name__ == "__main__":
    main()
