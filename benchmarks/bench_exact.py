"""Speed of the exact tier on sampled rows, against the naive mpmath loop (extrapolated).

Run: ``python benchmarks/bench_exact.py`` (``--repeats N``, ``--naive-rows N``). Prints the
machine, then one row per configuration: rows x Sk x d, best-of-N seconds, rows/s and the
largest certified bound on O (absolute, with max|V| = O(1)). Timings on a shared 2-core VM are
noisy (+-30 %), hence best-of-N.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import mpmath
import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, Mask
from attention_crossval.reference.exact import exact_attention, naive_exact_attention, sample_rows
from benchmarks.machine import blas_threads, cpu_model


def machine() -> str:
    """Platform, CPU model, cores, mpmath backend, numpy version."""
    cpu = cpu_model()
    return (
        f"{platform.platform()} | {cpu} | {os.cpu_count()} cores | Python "
        f"{platform.python_version()} | numpy {np.__version__} | mpmath {mpmath.__version__} "
        f"(backend {mpmath.libmp.BACKEND}) | BLAS threads "
        f"{blas_threads()} | load average {os.getloadavg()[0]:.1f}"
    )


def make_case(sq: int, sk: int, d: int, dtype: str, *, causal: bool = False) -> AttentionCase:
    """Q, K, V ~ N(0,1) * (1.5, 1.5, 1) rounded to ``dtype`` (docs/numerics.md#exact-speed)."""
    rng = np.random.default_rng(0)
    arrays = [
        (rng.standard_normal(shape) * scale).astype(np.float32).astype(INPUT_DTYPES[dtype])
        for shape, scale in (((1, sq, 1, d), 1.5), ((1, sk, 1, d), 1.5), ((1, sk, 1, d), 1.0))
    ]
    return AttentionCase(*arrays, mask=Mask(causal=causal))


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument("--naive-rows", type=int, default=2, help="rows for the naive loop")
    args = parser.parse_args(argv)
    print(machine())
    header = f"{'engine':<8} {'dtype':<9} {'mask':<7} {'bits':>4} {'rows x Sk x d':>16}"
    print(f"{header} {'seconds':>8} {'rows/s':>8} {'max o_err_bound':>16}")
    configs = [
        (64, 8192, 128, "float16", False, 128),  # the design target
        (64, 8192, 128, "float16", False, 100),
        (64, 8192, 128, "bfloat16", False, 128),
        (64, 8192, 128, "float32", False, 128),
        (64, 8192, 128, "float16", True, 128),
        (8, 1024, 128, "float16", False, 128),
    ]
    for n, sk, d, dtype, causal, bits in configs:
        case = make_case(max(n, 512), sk, d, dtype, causal=causal)
        rows = sample_rows(case, n, seed=0)
        run = functools.partial(exact_attention, case, rows, prec_bits=bits)
        seconds, result = best_of(args.repeats, run)
        mask = "causal" if causal else "none"
        shape = f"{n} x {sk} x {d}"
        print(
            f"{'exact':<8} {dtype:<9} {mask:<7} {bits:>4} {shape:>16} {seconds:>8.2f} "
            f"{n / seconds:>8.1f} {np.nanmax(result.o_err_bound):>16.2e}"
        )
    naive_sk, target_sk, target_rows = 1024, 8192, 64
    case = make_case(512, naive_sk, 128, "float16")
    rows = sample_rows(case, args.naive_rows, seed=0)
    seconds, naive = best_of(1, functools.partial(naive_exact_attention, case, rows))
    exact = exact_attention(case, rows)
    agree = np.nanmax(np.abs(naive.o - exact.o))
    per_row = seconds / args.naive_rows
    print(
        f"{'naive':<8} {'float16':<9} {'none':<7} {'332':>4} "
        f"{f'{args.naive_rows} x {naive_sk} x 128':>16} {seconds:>8.2f} {1 / per_row:>8.2f}"
        f" {'(dps 100)':>16}"
    )
    estimate = per_row * target_sk / naive_sk * target_rows
    print(
        f"naive extrapolated (linear in Sk) to {target_rows} x {target_sk} x 128: {estimate:.0f} s;"
        f" exact vs naive max |o diff| on its rows: {agree:.1e} (both nearest doubles)"
    )


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
