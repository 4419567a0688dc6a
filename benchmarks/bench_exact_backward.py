"""Speed of the exact backward tier: sampled dq rows plus sampled dk/dv key columns.

Run: ``python benchmarks/bench_exact_backward.py`` (``--repeats N``). Prints the machine (with
the load average, since the VM is shared), then one row per configuration: rows + keys sampled,
Sq = Sk, d, dtype, mask, bits, best-of-N seconds, the row statistics computed (every row that
sees a sampled key), and the largest certified radius relative to the largest |gradient|.
The target (issue 10): 64 dq rows + 64 dk/dv columns of Sq = Sk = 2048, d = 128, bf16 in
<= 30 s at >= 100 bits on 2 cores.

``--harness`` (``PYTHONPATH=src python -m benchmarks.bench_exact_backward --harness``) times the
whole backward harness instead, where the exact tier is one phase of a GPU test's CPU work: the
first ``--per-strategy`` cases each backward strategy of ``--kernel``'s declaration draws
(seeded; long keys and long decodes included), run through :func:`run_backward_case` with that
kernel's torch adapter moved to the CPU and the GPU suite's two exact samples, then the seconds
per phase (kernel/harness/phases.py) per strategy and in all, with the process's CPU seconds
(all threads; steadier than wall time on a shared machine). The kernel's padding-read check
is left out so the references run on every case (SDPA reads NaN padding on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections import defaultdict

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.phases import CLOCK, PHASES
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties.kernel_suite import backward_strategies
from attention_crossval.properties.strategies import drawn_examples
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


GPU_SAMPLES = 2  # exact rows and keys per case of a GPU kernel (properties/test_kernels_backward)
HARNESS_PHASES = ("kernel", "float64", "exact", "bound", "streaming", "compare")


def harness_phases(kernel: str, per_strategy: int, seed: int) -> None:
    """Per backward strategy of ``kernel``: cases, wall seconds and seconds per phase of the
    backward harness on its first ``per_strategy`` seeded cases (module docstring)."""
    adapter = resolve(kernel)
    on_cpu = dataclasses.replace(adapter, spec=dataclasses.replace(adapter.spec, device="cpu"))
    strategies = backward_strategies(adapter.spec)
    import torch

    print(
        f"kernel {kernel} on the CPU; {per_strategy} cases per strategy, seed {seed}; torch "
        f"threads {torch.get_num_threads()}"
    )
    columns = [*HARNESS_PHASES, "other"]
    head = f"{'strategy':<16} {'cases':>5} {'wall s':>7} {'cpu s':>7} "
    print(head + " ".join(f"{c:>9}" for c in columns))
    total: dict[str, float] = defaultdict(float)
    for name, strategy in strategies.items():
        cases = drawn_examples(strategy, per_strategy, seed=seed)
        CLOCK.take()
        start, cpu = time.perf_counter(), time.process_time()
        for case in cases:
            run_backward_case(
                on_cpu, case, samples=GPU_SAMPLES, skip_checks=frozenset({"padding-read"})
            )
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        seconds = {phase: spent for phase, (spent, _) in CLOCK.take().items() if phase in PHASES}
        row = {c: seconds.get(c, 0.0) for c in HARNESS_PHASES}
        row["other"] = wall - sum(seconds.values())
        for column, value in (("cases", len(cases)), ("wall", wall), ("cpu", cpu), *row.items()):
            total[column] += value
        print(
            f"{name:<16} {len(cases):>5} {wall:>7.2f} {cpu:>7.2f} "
            + " ".join(f"{row[c]:>9.2f}" for c in columns),
            flush=True,
        )
    print(
        f"{'all':<16} {int(total['cases']):>5} {total['wall']:>7.2f} {total['cpu']:>7.2f} "
        + " ".join(f"{total[c]:>9.2f}" for c in columns)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument(
        "--harness", action="store_true", help="time the backward harness per phase instead"
    )
    parser.add_argument("--kernel", default="sdpa-math", help="--harness: whose strategies")
    parser.add_argument("--per-strategy", type=int, default=6, help="--harness: cases each")
    parser.add_argument("--seed", type=int, default=1, help="--harness: the strategies' seed")
    args = parser.parse_args(argv)
    print(machine())
    if args.harness:
        harness_phases(args.kernel, args.per_strategy, args.seed)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        return
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
