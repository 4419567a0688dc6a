"""Instruction counts of an SM90 attention kernel's overlapped KV loops, from its SASS, on a CPU.

Compiles for sm_90a on fake tensors (no GPU) and counts the instructions of every loop that holds
the overlap's two waits (``WARPGROUP.DEPBAR.LE gsb0, 0x1`` then ``0x0``), by opcode, in three
parts: before the first wait (the GEMM issue), between the waits (what runs while the PV WGMMA
may still run), after the second (what runs once it is done). The own kernel's figures in
docs/results-h200.md, and flash_attn.cute's beside them, come from this script::

    python scripts/sm90_sass.py own --head-dim 128              # the adapters' default knobs
    python scripts/sm90_sass.py own --head-dim 64 --causal --knobs overlap,m192
    python scripts/sm90_sass.py flash-attn --head-dim 128       # needs flash-attn-4, torch

``own`` builds the kernel as the adapters do (kernel/adapters/own_sm90.py ``make_kernel``);
``flash-attn`` builds flash_attn.cute's ``FlashAttentionForwardSm90`` with the tile and flags its
interface picks for bf16 on SM90 (192 x 128 tiles at D = 64, else 128 x 128; register P,
intra-warpgroup overlap, 2 stages). ``cuobjdump`` comes from ``--cuobjdump``, the PATH, or the
triton package (``pip install triton`` ships one).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

PARTS = ("before wait 1", "between waits", "after wait 0")
OPCODES = ("HGMMA", "MUFU", "FMNMX", "FADD", "FFMA", "FMUL", "FSEL", "F2FP", "SHFL", "BAR", "SYNCS")


def find_cuobjdump(given: str | None) -> str:
    """``given``, else ``cuobjdump`` on the PATH, else the one in the triton package."""
    found = given or shutil.which("cuobjdump")
    if found is None:
        try:
            import triton

            bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            found = str(bundled) if bundled.is_file() else None
        except ImportError:
            pass
    if found is None:
        raise SystemExit("no cuobjdump: pass --cuobjdump, put one on PATH or pip install triton")
    return found


def own_kernel(head_dim: int, causal: bool, knobs: tuple[str, ...]) -> Callable[[str], object]:
    """Compiles the own SM90 kernel with ``knobs`` (its own ``compile``: fake tensors, sm_90a)
    with the options given."""
    from attention_crossval.kernel.adapters.own_sm90 import make_kernel

    kernel = make_kernel("bfloat16", head_dim, causal, **dict.fromkeys(knobs, True))
    return lambda options: kernel.compile(options=options)


def flash_attn_kernel(head_dim: int, causal: bool) -> Callable[[str], object]:
    """Compiles flash_attn.cute's SM90 forward as its interface builds it for bf16, on fake
    tensors for sm_90a, with the options given."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # its constructor reads the target arch
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData

    from attention_crossval.kernel.own.common.host import fake_arguments

    tile_m = 192 if head_dim <= 64 else 128
    kernel = FlashAttentionForwardSm90(
        cutlass.BFloat16, head_dim, head_dim, 1, is_causal=causal, is_local=False,
        pack_gqa=False, tile_m=tile_m, tile_n=128, num_stages=2, num_threads=384,
        Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True, mask_mod=None,
        score_mod=None, has_aux_tensors=False, q_subtile_factor=1, paged_kv_non_tma=False,
    )  # fmt: skip
    q, k, v, o, lse, _, stream = fake_arguments(cutlass.BFloat16)
    # softmax_scale, then (cu_seqlens q/k, seqused q/k, page table, window l/r, sink, block
    # sparsity) None, aux data, (the two tile cumsums) None, the stream: interface.py's order.
    args = (q, k, v, o, lse, Float32(head_dim**-0.5), *[None] * 9, AuxData(None, None))
    args = (*args, None, None, stream)
    return lambda options: cute.compile(kernel, *args, options=f"--gpu-arch=sm_90a {options}")


def sass(compile_kernel: Callable[[str], object], cuobjdump: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of the kernel ``compile_kernel`` builds, from its kept cubin."""
    with tempfile.TemporaryDirectory() as dump:
        compile_kernel(f"--keep-cubin --dump-dir={dump}")
        (cubin,) = Path(dump).glob("*.cubin")
        text = subprocess.run(
            [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    found = (re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line) for line in text.splitlines())
    return [(int(m.group(1), 16), m.group(2)) for m in found if m]


def opcode(instruction: str) -> str:
    """The opcode without predicate and modifiers: ``@!P0 HGMMA.64x128x16...`` -> ``HGMMA``."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def overlap_loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The bodies (a backward branch's target up to it) of the KV loops: both GEMMs (S with A
    from shared memory, PV with A from registers) and exactly one of each wait. Retry branches
    of barrier waits, placed out of line after a loop, jump back into it too; their spans hold
    the waits of more than one step, so the "exactly one" leaves them out."""
    loops = []
    for end, (address, instruction) in enumerate(code):
        target = re.search(r"BRA (?:`\()?0x([0-9a-f]+)", instruction)
        if target and int(target.group(1), 16) < address:
            body = [i for a, i in code[: end + 1] if a >= int(target.group(1), 16)]
            waits = [w for i in body for w in re.findall(r"DEPBAR\.LE gsb0, (0x[01])", i)]
            gemms = {"S": r"HGMMA\S* R\d+, gdesc", "PV": r"HGMMA\S* R\d+, R\d+, gdesc"}
            if waits == ["0x1", "0x0"] and all(
                any(re.search(g, i) for i in body) for g in gemms.values()
            ):
                loops.append(body)
    return loops


def parts(body: list[str]) -> list[collections.Counter]:
    """Opcode counts before the first wait, between the waits and after the second."""
    counts, part = [collections.Counter() for _ in PARTS], 0
    for instruction in body:
        wait = re.search(r"DEPBAR\.LE gsb0, 0x([01])", instruction)
        if wait and (part, wait.group(1)) in ((0, "1"), (1, "0")):
            part += 1  # the waits themselves belong to no part
        else:
            counts[part][opcode(instruction)] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("own", "flash-attn"))
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--knobs", default=None, help="own: comma-separated (default: DEFAULT_KNOBS)"
    )
    parser.add_argument("--cuobjdump", default=None)
    args = parser.parse_args(argv)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    if args.kernel == "own":
        from attention_crossval.kernel.adapters.own_sm90 import DEFAULT_KNOBS

        knobs = DEFAULT_KNOBS if args.knobs is None else tuple(args.knobs.split(","))
        compile_kernel = own_kernel(args.head_dim, args.causal, knobs)
    else:
        compile_kernel = flash_attn_kernel(args.head_dim, args.causal)
    code = sass(compile_kernel, cuobjdump)
    print(f"{args.kernel} D={args.head_dim} causal={args.causal}: {len(code)} instructions")
    for n, body in enumerate(overlap_loops(code)):
        print(f"  loop {n}: {len(body)} instructions")
        for name, counts in zip(PARTS, parts(body), strict=True):
            named = " ".join(f"{op} {counts[op]}" for op in OPCODES if counts[op])
            other = sum(v for op, v in counts.items() if op not in OPCODES)
            print(f"    {name:14s} {sum(counts.values()):4d}: {named} other {other}")


if __name__ == "__main__":
    main()
