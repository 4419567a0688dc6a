"""Probe the FP8 WGMMA's accumulator on a Hopper GPU: how many bits it keeps, and whether every
product or only the sum loses the bits below the largest product's grid
(docs/fp8.md#mma-accumulation).

    python scripts/gpu/fp8_mma_probe.py              # on an sm_90 GPU
    python scripts/gpu/fp8_mma_probe.py --interpret  # Triton's interpreter: fp32, exact sums

One k32 FP8 WGMMA (Triton ``tl.dot``, e4m3, ``max_num_imprecise_acc=32``: one partial sum
from zero) of a row ``[2^a, 1, ..., 1]`` and a column ``[2^b, 1, ..., 1]`` (``a + b = k``): one
product ``2^k`` and 31 products 1, exact sum ``2^k + 31``. The table's ``excess`` is the
result minus ``2^k``, and what each model gives with ``bits`` significant bits (truncating):

* fp32: 31 while ``k <= 18`` (``2^k + 31`` fits 24 bits);
* every product cut on the largest one's grid ``2^(k + 1 - bits)`` (the model the chain
  declares): 31 while ``k + 1 - bits <= 0``, 0 from there (each 1 is below the grid);
* only the sum cut to ``bits``: ``31`` cut to the grid ``2^(k + 1 - bits)``, e.g. 30 at
  ``k = bits``, 24 at ``k = bits + 2``.

The ``k`` where ``excess`` leaves 31 gives ``bits``; 0 after it confirms the declared model. A
second column adds the 31 ones onto an accumulator ``C = 2^k`` (a chain never promoted): K = 64
with ``max_num_imprecise_acc=64``, two k32 WGMMA steps chained in the tensor core, ``2^k`` from
the first, the ones in the second. (Below 32 Triton gives up the FP8 WGMMA.)
"""

from __future__ import annotations

import argparse
import os
import sys

K_STEP = 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true", help="run Triton's interpreter")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit runs
        from attention_crossval.properties.triton_interpreter import patch_interpreter

        patch_interpreter()
    import torch
    import triton
    import triton.language as tl

    device = "cpu" if args.interpret else "cuda"

    @triton.jit
    def dot_kernel(A, B, OUT, K: tl.constexpr):
        rows = tl.arange(0, 64)
        cols = tl.arange(0, 64)
        ks = tl.arange(0, K)
        a = tl.load(A + rows[:, None] * K + ks[None, :])
        b = tl.load(B + ks[:, None] * 64 + cols[None, :])
        acc = tl.dot(a, b, max_num_imprecise_acc=K)  # one partial sum of K products from zero
        tl.store(OUT + rows[:, None] * 64 + cols[None, :], acc)

    def run(row: list[float], column: list[float]) -> float:
        k = len(row)
        a = torch.zeros(64, k)
        b = torch.zeros(k, 64)
        a[0] = torch.tensor(row)
        b[:, 0] = torch.tensor(column)
        a8 = a.to(torch.float8_e4m3fn).to(device)
        b8 = b.to(torch.float8_e4m3fn).to(device)
        out = torch.zeros(64, 64, dtype=torch.float32, device=device)
        dot_kernel[(1,)](a8, b8, out, K=k)
        return float(out[0, 0].cpu())

    print("| k | one WGMMA from zero: excess | chained onto C = 2^k: excess |")
    print("|---|---|---|")
    for k in range(8, 17):
        a, b = (k + 1) // 2, k // 2  # e4m3 holds 2^8 at most: a, b <= 8
        ones = [1.0] * (K_STEP - 1)
        single = run([2.0**a, *ones], [2.0**b, *ones]) - 2.0**k
        # C = 2^k from a first step (2^a 2^b and zeros), the 31 ones in the second step
        chained_row = [2.0**a] + [0.0] * (K_STEP - 1) + [0.0, *ones]
        chained_col = [2.0**b] + [0.0] * (K_STEP - 1) + [0.0, *ones]
        chained = run(chained_row, chained_col) - 2.0**k
        print(f"| {k} | {single:g} | {chained:g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
