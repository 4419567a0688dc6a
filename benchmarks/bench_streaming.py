"""Time and peak memory of the streaming tier per tile size.

Run: ``python benchmarks/bench_streaming.py [--seq 4096 --head-dim 128 --blocks 64x64,128x128]``.

Shows that the tier's memory follows the tile (block_m x block_n scores, P, and the running
O / row_sum of one row block), not Sq x Sk: the full score matrix is never formed. Peak memory is
measured with tracemalloc (NumPy reports its buffers to it) in a run separate from the timed one,
since tracing slows allocation.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from benchmarks.machine import blas_threads, cpu_model

MIB = 2**20


def machine() -> str:
    """CPU model, logical cores, numpy version and BLAS thread setting."""
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}, BLAS threads {blas_threads()}"
    )


def make_case(S: int, D: int, dtype: str, seed: int = 0) -> AttentionCase:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(1, S, 1, D)).astype(INPUT_DTYPES[dtype]) for _ in range(3))
    return AttentionCase(q, k, v)


def measure(
    case: AttentionCase, precision: StreamingPrecision, block: tuple[int, int]
) -> tuple[float, int]:
    """Seconds for one call, and the peak bytes allocated during a second (traced) call."""
    start = time.perf_counter()
    streaming_attention(case, precision, block_m=block[0], block_n=block[1])
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        streaming_attention(case, precision, block_m=block[0], block_n=block[1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak


def parse_block(text: str) -> tuple[int, int]:
    block_m, _, block_n = text.partition("x")
    return int(block_m), int(block_n or block_m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="Sq = Sk (default 4096)")
    parser.add_argument("--head-dim", type=int, default=128, help="D = Dv (default 128)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(INPUT_DTYPES))
    parser.add_argument(
        "--blocks",
        type=lambda text: [parse_block(b) for b in text.split(",")],
        default=[(64, 64), (128, 64), (128, 128), (128, 256), (256, 256), (512, 512), (1024, 1024)],
        help="comma-separated block_m x block_n tiles, e.g. 64x64,128x128",
    )
    args = parser.parse_args()
    case = make_case(args.seq, args.head_dim, args.dtype)
    precision = StreamingPrecision.flash_attention(args.dtype)
    outputs = case.B * case.Sq * case.Hq * case.Dv * 8 + case.B * case.Hq * case.Sq * 8
    full_scores = case.Sq * case.Sk * 4
    print(f"machine: {machine()}")
    print(
        f"case: {case.describe()}; chain: StreamingPrecision.flash_attention({args.dtype!r})\n"
        f"for scale: returned o + lse = {outputs / MIB:.1f} MiB; one fp32 Sq x Sk score matrix = "
        f"{full_scores / MIB:.1f} MiB"
    )
    print(f"{'block_m x block_n':>18} {'seconds':>9} {'peak MiB':>9} {'peak - outputs MiB':>19}")
    for block in args.blocks:
        seconds, peak = measure(case, precision, block)
        label = f"{block[0]} x {block[1]}"
        print(f"{label:>18} {seconds:9.2f} {peak / MIB:9.2f} {(peak - outputs) / MIB:19.2f}")


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
