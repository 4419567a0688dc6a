"""Time and peak memory of the streaming backward per tile size (forward run included).

Run from the repository root: ``python -m benchmarks.bench_streaming_backward
[--seqs 2048,4096 --head-dim 128 --blocks 64x64,128x128]``.

Shows that the backward's memory follows the tile (the block_m x block_n S, P, dP, dS of one
tile) plus output-sized arrays (O, LSE, dq, dk, dv and their accumulators), not Sq x Sk. Peak
memory is measured with tracemalloc in a run separate from the timed one (tracing slows
allocation); "beyond outputs" subtracts the float64 o, lse, dq, dk, dv the call returns or
holds, so what is left is accumulators and tile temporaries.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.reference.case import INPUT_DTYPES
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.precision import BackwardPrecision
from attention_crossval.reference.streaming_backward import streaming_backward
from benchmarks.bench_streaming import MIB, machine, make_case, parse_block


def make_backward_case(S: int, D: int, dtype: str, seed: int = 0) -> BackwardCase:
    case = make_case(S, D, dtype, seed)
    do = np.random.default_rng(seed + 1).normal(size=(1, S, 1, D)).astype(INPUT_DTYPES[dtype])
    return BackwardCase(case, do)


def measure(
    case: BackwardCase, precision: BackwardPrecision, block: tuple[int, int]
) -> tuple[float, int]:
    """Seconds for one call, and the peak bytes allocated during a second (traced) call."""
    start = time.perf_counter()
    streaming_backward(case, precision, block_m=block[0], block_n=block[1])
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        streaming_backward(case, precision, block_m=block[0], block_n=block[1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seqs",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[2048, 4096],
        help="comma-separated Sq = Sk values (default 2048,4096)",
    )
    parser.add_argument("--head-dim", type=int, default=128, help="D = Dv (default 128)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(INPUT_DTYPES))
    parser.add_argument(
        "--blocks",
        type=lambda text: [parse_block(b) for b in text.split(",")],
        default=[(64, 64), (128, 128), (128, 256), (256, 256), (512, 512)],
        help="comma-separated block_m x block_n tiles, e.g. 64x64,128x128",
    )
    args = parser.parse_args()
    precision = BackwardPrecision.flash_attention(args.dtype)
    print(f"machine: {machine()}")
    print(
        f"chain: BackwardPrecision.flash_attention({args.dtype!r}) (its forward run included); "
        f"B=1, H=1, D=Dv={args.head_dim}"
    )
    print(
        f"{'Sq = Sk':>8} {'block_m x block_n':>18} {'seconds':>9} {'peak MiB':>9} "
        f"{'beyond outputs MiB':>19} {'fp32 Sq x Sk MiB':>17}"
    )
    for seq in args.seqs:
        case = make_backward_case(seq, args.head_dim, args.dtype)
        f = case.forward
        outputs = 8 * (f.Sq * f.Dv + f.Sq + f.Sq * f.D + f.Sk * (f.D + f.Dv))  # o lse dq dk dv
        for block in args.blocks:
            seconds, peak = measure(case, precision, block)
            label = f"{block[0]} x {block[1]}"
            print(
                f"{seq:>8} {label:>18} {seconds:9.2f} {peak / MIB:9.2f} "
                f"{(peak - outputs) / MIB:19.2f} {seq * seq * 4 / MIB:17.1f}",
                flush=True,
            )


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
