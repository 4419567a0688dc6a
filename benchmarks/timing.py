"""GPU timing for the benchmark tables: TFLOP/s by ``triton.testing``, a failure as NaN.

Shared by benchmarks/bench_own_sm90.py, scripts/check_own_sm90.py and
scripts/gpu/bench_own_sm90_full.py; triton and torch are imported only when a call is timed.

Two clocks. ``do_bench`` times calls launched one after another from Python, so a call whose
host work (argument conversion, launch) takes longer than its kernel measures the host: on the
H200 a 43 us own-kernel launch at 16 x 16 x 1024 causal timed 250 or 390 TFLOP/s
from one round to the next. ``graph=True`` captures the calls in a CUDA graph and times its
replays (``do_bench_cudagraph``), so only the kernels' device time counts, for every kernel
alike; that is the clock for comparing kernels.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable


def tflops(
    flops: float,
    fn: Callable[[], object],
    *,
    warmup: int = 25,
    rep: int = 100,
    graph: bool = False,
) -> float:
    """TFLOP/s of ``fn``: the median of ``do_bench`` over ``rep`` ms after ``warmup`` ms, or
    with ``graph`` of ``do_bench_cudagraph`` over ``rep`` ms (one call first either way:
    compile and errors stay outside the timing). A call that cannot be captured in a graph is
    timed by ``do_bench``, with a note on stderr. NaN, with the call's name and traceback on
    stderr, when it raises: a failing kernel gives NaN in its cell and the others go on."""
    from triton.testing import do_bench, do_bench_cudagraph

    name = getattr(fn, "__name__", fn)
    try:
        fn()
        if graph:
            try:
                return flops / do_bench_cudagraph(fn, rep=rep, return_mode="median") / 1e9
            except Exception as error:  # noqa: BLE001 - not capturable: timed without a graph
                print(f"--- {name}: no CUDA graph ({error!r}); timed by do_bench", file=sys.stderr)
        return flops / do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e9
    except Exception:  # noqa: BLE001 - reported, and NaN in the table
        print(f"--- {name} failed:", file=sys.stderr)
        traceback.print_exc()
        return float("nan")


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds of host time per call of ``fn``: ``calls`` calls issued in a row after one
    untimed call and a synchronize, without waiting for the GPU in between (200 launches stay
    far below the CUDA launch queue's depth, so none waits for a free slot). What a launch path
    costs the caller, whatever its kernel takes; NaN, with the traceback, when ``fn`` raises."""
    import time

    import torch

    name = getattr(fn, "__name__", fn)
    try:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6
    except Exception:  # noqa: BLE001 - reported, and NaN in the table
        print(f"--- {name} failed:", file=sys.stderr)
        traceback.print_exc()
        return float("nan")
