"""What checking a long-context kernel costs, per phase, against the sequence length.

Run: ``python benchmarks/bench_long_context.py`` (on a GPU host: flash-attn-cute;
``--kernel NAME_OR_PATH``, ``--lengths 4096 16384``, ``--mode prefill|decode|both``,
``--rows N`` exact rows). For each length S it checks one case of the ``gpu-long`` shape
(bf16, D = 128, Hq = 8, Hkv = 2; prefill: causal Sq = Sk = S; decode: Sq = 1, Sk = S, B = 8)
exactly as ``attention-report`` does, and prints the machine, then one row per case: the
record's seconds per phase (docs/long-context.md#timing), what no phase accounts for, and the
kernel's own run time (median of 5 launches timed with CUDA events, inputs already on the GPU;
for a CPU kernel one call), so the overhead of checking is visible next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

from threadpoolctl import threadpool_limits

from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.reference.case import AttentionCase
from attention_crossval.report.cache import ExactCache
from attention_crossval.report.configs import Config
from attention_crossval.report.runner import PHASES, Kernel, RunOptions, evaluate
from benchmarks.machine import cpu_model

LENGTHS = (4096, 16384, 65536, 131072)


def machine() -> str:
    """Host, CPU, cores and the GPU torch sees (if any)."""
    cpu = cpu_model()
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    except ImportError:
        gpu = "no torch"
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cores | {gpu}"


def config(mode: str, length: int) -> Config:
    """The gpu-long shape at ``length`` keys."""
    shape = {"dtype": "bfloat16", "D": 128, "Hq": 8, "Hkv": 2}
    if mode == "prefill":
        return Config(**shape, Sq=length, Sk=length, mask="causal", name=f"prefill-{length}")
    return Config(**shape, Sq=1, Sk=length, B=8, name=f"decode-b8-{length}")


def own_seconds(adapter: object, case: AttentionCase) -> float:
    """The kernel alone: median of 5 CUDA-event-timed launches on device inputs (a guarded
    torch adapter), else the wall time of one call."""
    if not hasattr(adapter, "launch"):
        start = time.perf_counter()
        adapter(case)
        return time.perf_counter() - start
    import torch

    from attention_crossval.kernel.adapters._torch import GuardedOutput, to_device

    q, k, v = (to_device(getattr(case, name)) for name in "qkv")
    out = GuardedOutput.allocate((case.B, case.Sq, case.Hq, case.Dv), case.dtype, axis=1,
                                 prefill="zero")  # fmt: skip
    lse = GuardedOutput.allocate((case.B, case.Hq, case.Sq), "float32", axis=2, prefill="zero")
    adapter.launch(case, q, k, v, out.view, lse.view)  # compile and warm up
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        adapter.launch(case, q, k, v, out.view, lse.view)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="flash-attn-cute")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--mode", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument("--rows", type=int, default=8, help="exact rows per case (at most)")
    args = parser.parse_args()
    modes = ("prefill", "decode") if args.mode == "both" else (args.mode,)
    print(f"machine: {machine()}")
    print(f"kernel: {args.kernel}; exact rows <= {args.rows}; seconds per phase")
    shown = [p.removesuffix("_s") for p in PHASES]
    header = ["case", "verdict", "total", *shown, "unaccounted", "kernel own"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    worker = IsolatedKernel(args.kernel, timeout_s=600.0)
    adapter = resolve(args.kernel)  # in this process too, for the kernel's own run time
    try:
        with tempfile.TemporaryDirectory() as cache:
            for mode in modes:
                for length in args.lengths:
                    recipe = config(mode, length)
                    kernel = Kernel(args.kernel, worker, worker)
                    options = RunOptions(rows=args.rows)
                    (record,) = evaluate(recipe, [kernel], options, ExactCache(cache))
                    timing = record.get("timing", {})
                    own = own_seconds(adapter, recipe.build())
                    cells = [f"{timing.get(p, 0.0):.2f}" for p in PHASES]
                    row = [recipe.name, record["verdict"], f"{timing.get('total_s', 0.0):.1f}"]
                    row += [*cells, f"{timing.get('unaccounted_s', 0.0):.2f}", f"{own:.4f}"]
                    print("| " + " | ".join(row) + " |", flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
