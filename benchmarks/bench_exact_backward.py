"""Speed of the exact backward tier: sampled dq rows plus sampled dk/dv key columns.

Run: ``python benchmarks/bench_exact_backward.py`` (``--repeats N``). Prints the machine (with
the load average, since the VM is shared), then one row per configuration: rows + keys sampled,
Sq = Sk, d, dtype, mask, bits, best-of-N seconds, the row statistics computed (every row that
sees a sampled key), and the largest certified radius relative to the largest |gradient|.
The target (issue 10): 64 dq rows + 64 dk/dv columns of Sq = Sk = 2048, d = 128, bf16 in
<= 30 s at >= 100 bits on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.reference.case import INPUT_DTYPES
from attention_crossval.reference.exact import sample_rows
from attention_crossval.reference.exact_backward import exact_backward, sample_keys
from attention_crossval.reference.gradients import BackwardCase
from benchmarks.bench_exact import best_of, machine, make_case


def make_backward_case(s: int, d: int, dtype: str, *, causal: bool = False) -> BackwardCase:
    """The forward benchmark's Q, K, V (N(0,1) x 1.5, 1.5, 1) plus dO ~ N(0, 1), in ``dtype``."""
    forward = make_case(s, s, d, dtype, causal=causal)
    do = np.random.default_rng(1).standard_normal((1, s, 1, d)).astype(np.float32)
    return BackwardCase(forward, do.astype(INPUT_DTYPES[dtype]))


def relative_radius(result) -> float:
    """Largest certified radius over the largest |value| among dq, dk, dv."""
    worst = 0.0
    for name in ("dq", "dk", "dv"):
        value = getattr(result, name)
        radius = getattr(result, f"{name}_err_bound")
        worst = max(worst, float(np.nanmax(radius) / np.nanmax(np.abs(value))))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs (default 3)")
    args = parser.parse_args(argv)
    print(machine())
    header = f"{'dtype':<9} {'mask':<7} {'bits':>4} {'rows+keys':>9} {'Sq=Sk':>6} {'d':>4}"
    print(f"{header} {'seconds':>8} {'stat rows':>9} {'radius/max|grad|':>17}")
    configs = [
        (64, 2048, 128, "bfloat16", False, 128),  # the target (>= 100 bits)
        (64, 2048, 128, "bfloat16", False, 100),
        (64, 2048, 128, "float16", False, 128),
        (64, 2048, 128, "float32", False, 128),
        (64, 2048, 128, "bfloat16", True, 128),
        (16, 1024, 128, "bfloat16", False, 128),
    ]
    for n, s, d, dtype, causal, bits in configs:
        case = make_backward_case(s, d, dtype, causal=causal)
        rows, keys = sample_rows(case.forward, n, seed=0), sample_keys(case, n, seed=0)
        run = functools.partial(exact_backward, case, rows=rows, keys=keys, prec_bits=bits)
        seconds, result = best_of(args.repeats, run)
        stat_rows = int(np.isfinite(result.d).sum())
        mask = "causal" if causal else "none"
        print(
            f"{dtype:<9} {mask:<7} {bits:>4} {f'{n}+{n}':>9} {s:>6} {d:>4} {seconds:>8.2f} "
            f"{stat_rows:>9} {relative_radius(result):>17.2e}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
