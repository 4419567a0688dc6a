"""The FP8 MMA's narrow accumulator on the H200 check's cases, on the CPU: the bound, and the
emulated error, with and without it declared.

Run from the repository root: ``python -m benchmarks.bench_fp8_accumulation [--keys N]``.
For each trigger of ``scripts/gpu/fp8_check.py`` (``testing/broken/triton_fp8.TRIGGERS``) and
the chain ``triton-fp8`` declares (Hopper's 14-bit truncating accumulator, promoted every 32
products), and the same chain with fp32 MMAs: the streaming tier's emulation of the declared
chain against a float64 streaming reference, O (largest error / bound) and LSE (largest error,
smallest and median bound). ``--lse-error`` is an LSE error measured on the GPU, compared with
the smallest LSE bound of each case. ``--keys`` gives every case that many keys (a longer ramp:
larger logits). The FA4 column: the streaming tier with FA4's constants (8 and 4, e4m3) and the
same accumulator, its largest O error over the declared chain's bound (> 1: caught).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.streaming import FLOAT64_PRECISION, streaming_attention
from attention_crossval.testing.broken.triton_fp8 import (
    BLOCK_M,
    BLOCK_N,
    FA4,
    TRIGGERS,
    creep_case,
)
from attention_crossval.testing.broken.triton_fp8 import fixed as triton_fp8
from benchmarks.machine import blas_threads, cpu_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=None, help="keys per case")
    parser.add_argument("--lse-error", type=float, default=5.2e-4, help="a measured LSE error")
    args = parser.parse_args()
    print(f"{cpu_model()}, BLAS threads {blas_threads()}; block {BLOCK_M}x{BLOCK_N}")
    header = (
        "case", "MMA accumulator", "emulated max |dO| / bound", "emulated max |dLSE|",
        "LSE bound min / median", f"{args.lse_error:g} inside", "FA4 max |dO| / bound", "seconds",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for dtype, options in TRIGGERS:
        if args.keys:
            options = {**options, "Sk": args.keys}
        case = creep_case(dtype, **options)
        reference = streaming_attention(case, FLOAT64_PRECISION, block_m=BLOCK_M, block_n=BLOCK_N)
        declared = triton_fp8().spec.precision_for(dtype)
        fp32 = dataclasses.replace(declared, mma_accumulator_bits=None, mma_promotion_interval=None)
        label = f"{dtype} Sq={case.Sq} Sk={case.Sk} D={case.D} Hq={case.Hq} {case.label}"
        label += " causal" if case.mask.causal else ""
        for chain in (declared, fp32):
            start = time.perf_counter()
            result = streaming_attention(case, chain, block_m=BLOCK_M, block_n=BLOCK_N)
            bound = error_bound(case, reference, chain, block_n=BLOCK_N)
            lse_bound = lse_error_bound(case, reference, chain, block_n=BLOCK_N)
            seconds = time.perf_counter() - start
            live = np.isfinite(reference.lse)
            o_fraction = np.max(np.abs(result.o - reference.o) / bound)
            fa4 = "-"
            if dtype in FA4:  # FA4's constants clamp P (e4m3 only)
                offset, threshold = FA4[dtype]
                broken = dataclasses.replace(
                    chain, max_offset_log2=offset, rescale_threshold_log2=threshold
                )
                clamped = streaming_attention(case, broken, block_m=BLOCK_M, block_n=BLOCK_N)
                fa4 = f"{np.max(np.abs(clamped.o - reference.o) / bound):.3g}"
            lse_error = np.max(np.abs(result.lse - reference.lse)[live])
            low, median = np.min(lse_bound[live]), np.median(lse_bound[live])
            mma = (
                "fp32"
                if chain.mma_accumulator_bits is None
                else f"{chain.mma_accumulator_bits} bits, every {chain.mma_promotion_interval}"
            )
            row = (
                label, mma, f"{o_fraction:.3g}", f"{lse_error:.3g}", f"{low:.3g} / {median:.3g}",
                "yes" if args.lse_error <= low else "no", fa4, f"{seconds:.1f}",
            )  # fmt: skip
            print("| " + " | ".join(row) + " |", flush=True)
            label = "same"


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):
        main()
