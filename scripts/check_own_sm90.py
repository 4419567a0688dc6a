"""GPU check of the project's own SM90 kernel (kernel/own/sm90/fwd.py) on a Hopper GPU.

Usage (from the repository root, CuTe DSL importable, e.g. installed from
wheels as docs/gpu.md describes)::

    CUTE_DSL_ARCH=sm_90a python scripts/check_own_sm90.py [--skip pytest] [--part bench]

Three independent parts, each in its own process with a time limit, so a failure, a hang or a
CUDA fault in one does not hide the others:

1. accuracy: a few shapes against a float64 torch reference, error as a fraction of the derived
   bound (reference/bounds.py) and in output-dtype ulps (reference/compare.py); the first call of
   each (dtype, D, causal) also reports its compile time;
2. the gpu-marked tests of tests/kernel/test_own_kernels.py (small Hypothesis example count);
3. throughput, bf16 D = 128, S = 4096 / 16384, causal and not, against torch SDPA's FLASH and
   cuDNN backends: TFLOP/s = 4 B H Sq Sk D / time (halved for causal), median of
   ``triton.testing.do_bench``.

Every part runs the kernel variant the registered adapter runs: ``DEFAULT_KNOBS`` unless
``ATTENTION_CROSSVAL_SM90_OVERLAP`` picks another (``=baseline`` for the kernel without knobs).

The summary table is printed last.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.timing import tflops  # noqa: E402

ACCURACY_SHAPES = [  # (B, H, Sq, Sk, D, dtype, causal)
    (2, 3, 256, 256, 128, "bfloat16", False),
    (1, 2, 200, 300, 64, "float16", False),
    (2, 2, 130, 389, 128, "bfloat16", True),
    (1, 2, 300, 129, 64, "float16", True),
    (1, 2, 1000, 1000, 128, "float16", True),
    (1, 1, 1, 1, 64, "bfloat16", False),
    (1, 2, 64, 2048, 128, "bfloat16", True),
]


def accuracy(rows: list[str]) -> None:
    import numpy as np

    from attention_crossval.kernel.adapters.own_sm90 import create
    from attention_crossval.kernel.harness.references import float64_reference
    from attention_crossval.reference.bounds import error_bound, lse_error_bound
    from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, Mask
    from attention_crossval.reference.compare import compare

    adapter = create()
    seen: set[tuple[str, int, bool]] = set()
    for B, H, Sq, Sk, D, dtype, causal in ACCURACY_SHAPES:
        label = f"B={B} H={H} Sq={Sq} Sk={Sk} D={D} {dtype} {'causal' if causal else 'full'}"
        try:
            rng = np.random.default_rng(Sq + 7 * Sk + D)
            q, k, v = (
                rng.standard_normal((B, n, H, D)).astype(INPUT_DTYPES[dtype]) for n in (Sq, Sk, Sk)
            )
            case = AttentionCase(q, k, v, mask=Mask(causal=causal), label=label)
            start = time.perf_counter()
            result = adapter(case)
            first = time.perf_counter() - start
            key = (dtype, D, causal)
            note = f"first call {first:.1f} s (compile)" if key not in seen else ""
            seen.add(key)
            reference = float64_reference(case, "cuda")
            precision = adapter.spec.precision_for(dtype)
            bound = error_bound(case, reference, precision, block_n=adapter.spec.tile_n)
            lse_bound = lse_error_bound(case, reference, precision, block_n=adapter.spec.tile_n)
            report = compare(
                result, reference, bound=bound, output_dtype=dtype, lse_bound=lse_bound
            )
            verdict = "PASS" if report.passed else "FAIL"
            print(f"[accuracy] {verdict} {label}: {report.summary()} {note}", flush=True)
            rows.append(
                f"accuracy  {verdict}  {label}: max|err| {report.max_abs:.3g}, "
                f"{report.max_bound_fraction:.3g} of bound, max {report.max_ulp:.3g} ulp, "
                f"lse max|err| {report.lse_max_abs:.3g}"
            )
        except Exception:  # noqa: BLE001 - report and go on to the next shape
            traceback.print_exc()
            rows.append(f"accuracy  ERROR {label}: see traceback above")


def run_pytest(rows: list[str], *, timeout_s: float) -> None:
    env = dict(os.environ, ATTENTION_CROSSVAL_PROFILE="debug")  # 10 examples, verbose
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/kernel/test_own_kernels.py",
        "-m",
        "gpu",
    ]
    command += ["-q", "-x", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, timeout=timeout_s, capture_output=True, text=True
        )
        output = done.stdout + done.stderr
        print(output[-6000:], flush=True)
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
        rows.append(
            f"pytest    rc={done.returncode} in {time.perf_counter() - start:.0f} s: {last[0]}"
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        print(output[-4000:], flush=True)
        rows.append(f"pytest    TIMEOUT after {timeout_s:.0f} s")


def _bench_shape(B: int, H: int, S: int, D: int, causal: bool) -> list[float]:
    """TFLOP/s of own-sm90 (the adapter's variant, :func:`knobs_from_env`), SDPA FLASH and SDPA
    cuDNN on one bf16 shape (Sq == Sk, so SDPA's top-left causal equals the kernel's
    bottom-right)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attention_crossval.kernel.adapters.own_sm90 import knobs_from_env, launch

    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    own = partial(launch, q, k, v, out, lse, D**-0.5, causal=causal, **knobs_from_env())
    cells = [tflops(flops, own)]
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=causal)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel(backend):
            cells.append(tflops(flops, sdpa))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # sanity: a fast wrong kernel is no result
        cells.append((out.float() - sdpa().transpose(1, 2).float()).abs().max().item())
    return cells


def bench(rows: list[str]) -> None:
    rows.append("bench     bf16 D=128, TFLOP/s (median of triton do_bench):")
    header = ("B", "H", "S", "causal", "own-sm90", "sdpa-flash", "sdpa-cudnn", "max|own-flash|")
    widths = (2, 3, 6, 6, 9, 10, 10, 14)
    rows.append("bench     " + " ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for B, H, S in ((4, 16, 4096), (2, 16, 16384)):
        for causal in (False, True):
            try:
                cells = _bench_shape(B, H, S, 128, causal)
            except Exception:  # noqa: BLE001 - e.g. out of memory: NaN row, next shape
                traceback.print_exc()
                cells = [float("nan")] * 4
            speeds, diff = cells[:3], cells[3]
            values = (B, H, S, str(causal), *(f"{c:.0f}" for c in speeds), f"{diff:.3g}")
            line = "bench     " + " ".join(f"{x:>{w}}" for x, w in zip(values, widths, strict=True))
            print(line, flush=True)
            rows.append(line)


PARTS = {  # name -> (function, wall-clock limit of its process in seconds)
    "accuracy": (accuracy, 90.0),
    "pytest": (lambda rows: run_pytest(rows, timeout_s=100.0), 115.0),
    "bench": (bench, 80.0),
}


def run_part(name: str) -> None:
    """Run one part in this process; summary rows go to stdout prefixed with ``ROW``."""
    rows: list[str] = []
    try:
        PARTS[name][0](rows)
    except Exception:  # noqa: BLE001 - report, keep the rows gathered so far
        traceback.print_exc()
        rows.append(f"{name:<9} ERROR (traceback above)")
    for row in rows:
        print(f"ROW {row}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=list(PARTS), help="run one part in this process")
    parser.add_argument("--skip", action="append", default=[], choices=list(PARTS))
    args = parser.parse_args()
    if args.part:
        run_part(args.part)
        return
    # Each part in its own process: a hang or a CUDA fault (which poisons the context) in one
    # part costs only that part.
    rows: list[str] = []
    for name, (_, limit_s) in PARTS.items():
        if name in args.skip:
            continue
        start = time.perf_counter()
        command = [sys.executable, str(Path(__file__).resolve()), "--part", name]
        try:
            done = subprocess.run(
                command, cwd=ROOT, timeout=limit_s, capture_output=True, text=True
            )
            output, status = done.stdout + done.stderr, f"exit code {done.returncode}"
        except subprocess.TimeoutExpired as expired:
            output = "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                for part in (expired.stdout, expired.stderr)
            )
            status = f"TIMEOUT after {limit_s:.0f} s (hang?)"
        print(f"==== {name}: {status}, {time.perf_counter() - start:.0f} s ====")
        print("\n".join(line for line in output.splitlines() if not line.startswith("ROW ")))
        part_rows = [line[4:] for line in output.splitlines() if line.startswith("ROW ")]
        rows += part_rows or [f"{name:<9} no result ({status})"]
    print("\n==== own-sm90 summary ====")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
