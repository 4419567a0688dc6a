"""One launch each of the own SM90 kernel and flash_attn.cute's SM90 forward, for Nsight Compute.

Run under ``ncu`` on an H100/H200 (CuTe DSL and flash-attn-4 importable, the checkout on
PYTHONPATH), for example::

    ncu --clock-control none -k regex:FlashAttentionForwardSm90 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \\
        -o prof python3 scripts/gpu/profile_own_sm90.py --shape 4,16,4096,128 --causal 0

The own kernel launches first (its variant from ``--knobs``, default the registered adapters'
``DEFAULT_KNOBS``), then flash_attn.cute, each exactly once: the first call of each compiles and
runs, so ``--launch-count 2`` with the kernel-name filter profiles exactly these two launches
(both kernels' names contain ``FlashAttentionForwardSm90``). The outputs are compared after both
ran, so a profile of a wrong kernel says so. torch and flash_attn are imported only in
:func:`main`, so ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D (default %(default)s)")
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument(
        "--knobs", default=None, help="comma-separated own knobs (default: DEFAULT_KNOBS)"
    )
    args = parser.parse_args(argv)
    B, H, S, D = (int(x) for x in args.shape.split(","))

    import torch

    from attention_crossval.kernel.adapters.own_sm90 import DEFAULT_KNOBS, launch
    from benchmarks.peers import flash_attn_cute_forward

    knobs = DEFAULT_KNOBS if args.knobs is None else tuple(k for k in args.knobs.split(",") if k)
    gen = torch.Generator(device="cuda").manual_seed(S + D)
    q, k, v = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    scale = D**-0.5
    out_own, out_fa = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    lse_own, lse_fa = (torch.zeros(B, H, S, device="cuda") for _ in range(2))
    launch(q, k, v, out_own, lse_own, scale, causal=bool(args.causal), **dict.fromkeys(knobs, True))
    flash_attn_cute_forward(q, k, v, out_fa, lse_fa, scale, bool(args.causal))
    torch.cuda.synchronize()
    diff = (out_own.float() - out_fa.float()).abs().max().item()
    shape = f"{B}x{H}x{S}x{D} causal={args.causal}"
    print(f"own knobs {list(knobs)}; {shape}: max|own-FA| = {diff:.3g}")


if __name__ == "__main__":
    main()
