"""Which backward precision chain does a kernel follow? For saved backward cases (the ``.npz``
files a failing ``dq/dk/dv-bound`` check writes with ``--report-dir``), print the kernel's error
against float64 as a fraction of each candidate chain's bound, next to that chain's emulation.
The chain whose emulation reproduces the kernel's fractions, and whose bound then holds, is the
one to declare (this is how the SDPA backends' chains in kernel/adapters/sdpa.py were found).

    python scripts/gpu/backward_chains.py "sdpa-cudnn=out/sdpa-cudnn-backward-dk-bound-*.npz"

Each argument is ``KERNEL=GLOB``; the first 5 matching cases per kernel are read. The candidates
are the kernel's declared chain, FlashAttention's, and FlashAttention's with each
``BackwardPrecision`` flag turned on.
"""

from __future__ import annotations

import dataclasses
import glob
import sys

import numpy as np

from attention_crossval.kernel.harness.references_backward import float64_gradients
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.reference.bounds_backward import GRADIENTS, backward_error_bound
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.precision import BackwardPrecision
from attention_crossval.reference.streaming_backward import streaming_backward

FLAGS = ("ds_from_rounded_p", "ds_scaled", "ds_flushes_subnormals", "dkv_rounded_per_head")


def candidates(declared: BackwardPrecision, dtype: str) -> dict[str, BackwardPrecision]:
    """The declared chain, FlashAttention's (atomic dQ adds), and FlashAttention's with each
    flag turned on (the subnormal flush only where dS is rounded: 16-bit inputs)."""
    flash = BackwardPrecision.flash_attention(dtype, deterministic=False)
    out = {"declared": declared, "flash-attention": flash}
    flags = [f for f in FLAGS if f != "ds_flushes_subnormals" or flash.ds_dtype is not None]
    out.update({flag: dataclasses.replace(flash, **{flag: True}) for flag in flags})
    return out


def worst_fraction(tested: np.ndarray, reference: np.ndarray, bound: np.ndarray) -> float:
    """max |tested - reference| / bound (an error where the bound is 0 counts as inf)."""
    error = np.abs(np.asarray(tested, np.float64) - reference)
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(bound > 0, error / bound, np.where(error == 0, 0, np.inf))
    return float(np.nanmax(fraction))


def main(arguments: list[str]) -> None:
    for argument in arguments:
        name, pattern = argument.split("=", 1)
        adapter = resolve(name)
        spec = adapter.spec
        for path in sorted(glob.glob(pattern))[:5]:
            case = BackwardCase.load(path)
            kernel = adapter.backward(case)
            reference = float64_gradients(case)
            print(f"{name} {path}: {case.forward.describe()}")
            dtype = case.forward.dtype
            for label, chain in candidates(spec.backward_precision_for(dtype), dtype).items():
                bound = backward_error_bound(case, chain, reference, block_n=spec.tile_n)
                emulated = streaming_backward(case, chain, block_m=spec.tile_m, block_n=spec.tile_n)
                cells = []
                for g in GRADIENTS:
                    ref, limit = getattr(reference, g), getattr(bound, g)
                    ours = worst_fraction(getattr(kernel, g), ref, limit)
                    emul = worst_fraction(getattr(emulated, g), ref, limit)
                    cells.append(f"{g}: kernel {ours:.3g} / emulation {emul:.3g}")
                print(f"  {label:<22} error / bound  " + " | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
