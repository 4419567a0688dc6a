"""On how many seeds the default backward kernel suite catches each broken CPU backward.

Run from the repository root: ``python -m benchmarks.bench_backward_mutants --seeds 10``. For each
kernel-suite mutant of ``testing/broken/cpu_backward_faults.py`` (and the same adapter without a
bug, the control), runs ``test_kernel_backward_passes_every_check`` of
``properties/test_kernels_backward.py`` under the ``ci`` Hypothesis profile once per run seed
(``$ATTENTION_CROSSVAL_SEED`` = 0, 1, ...), each in its own pytest process, as CI would. Prints a
Markdown table: the seeds on which the test failed, the check named by each failure, the
seconds over all seeds.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = "attention_crossval.testing.broken.cpu_backward_faults"
TEST = "properties/test_kernels_backward.py::test_kernel_backward_passes_every_check"
MUTANTS = ("correct", "atomic_dq", "dq_16bit_accumulator", "ds_bf16", "dk_default_scale")
_CHECK = re.compile(r"CheckFailed: ([a-z-]+):")


def run_suite(kernel: str, seed: int, test: str = TEST) -> tuple[bool, str, float]:
    """One CI-profile run of ``test`` (default: the backward kernel test) on ``kernel`` (a
    mutant name of ``FAULTS``, or a dotted path): (failed, the failing check or the last output
    line, seconds)."""
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": "ci",
        "ATTENTION_CROSSVAL_SEED": str(seed),
        "PYTHONPATH": str(ROOT / "src"),  # spawned workers import the checkout, not an install
        "OPENBLAS_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "pytest", "-m", "cpu", "-q", "-p", "no:cacheprovider"]
    command += [test, "--kernel", kernel if ":" in kernel else f"{FAULTS}:{kernel}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    found = _CHECK.search(done.stdout)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return done.returncode != 0, found.group(1) if found else last, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_backward_mutants")
    parser.add_argument("--seeds", type=int, default=10, help="run seeds 0 .. N-1 (default 10)")
    parser.add_argument("--mutant", action="append", choices=MUTANTS, help="default: all")
    args = parser.parse_args(argv)
    print(
        f"machine: {platform.machine()} {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; ci profile, seeds 0..{args.seeds - 1}\n"
    )
    print("| kernel | failed on seeds | checks named | seconds (all seeds) |\n|---|---|---|---|")
    for name in args.mutant or MUTANTS:
        failed, checks, total = [], set(), 0.0
        for seed in range(args.seeds):
            fails, check, seconds = run_suite(name, seed)
            print(f"{name} seed {seed}: {check if fails else 'passed'}", file=sys.stderr)
            total += seconds
            if fails:
                failed.append(seed)
                checks.add(check)
        shown = " ".join(map(str, failed)) or "-"
        print(
            f"| {name} | {len(failed)}/{args.seeds}: {shown} | {', '.join(sorted(checks)) or '-'} "
            f"| {total:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
