"""GPU timing for the benchmark tables: TFLOP/s by ``triton.testing.do_bench``, a failure as NaN.

Shared by benchmarks/bench_own_sm90.py, scripts/check_own_sm90.py and
scripts/gpu/bench_own_sm90_full.py; triton is imported only when a call is timed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable


def tflops(flops: float, fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """TFLOP/s of ``fn`` by ``do_bench``'s median over ``rep`` ms after ``warmup`` ms (one call
    first: compile and errors stay outside the timing). NaN, with the call's name and traceback
    on stderr, when it raises: a failing kernel gives NaN in its cell and the others go on."""
    from triton.testing import do_bench

    try:
        fn()
        return flops / do_bench(fn, warmup=warmup, rep=rep) / 1e9
    except Exception:  # noqa: BLE001 - reported, and NaN in the table
        print(f"--- {getattr(fn, '__name__', fn)} failed:", file=sys.stderr)
        traceback.print_exc()
        return float("nan")
