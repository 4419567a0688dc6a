"""Where a pytest run of the kernel suites spends its time: seconds, share and calls per kernel
and phase (kernel/harness/phases.py), measured inside the harness of every test.

Runs the given pytest selection in a subprocess with ``--phase-timings`` and prints the
machine, the run's wall time, one table per kernel (its tests' phases; ``unattributed`` is the
rest of their time: Hypothesis, the harness' own analysis, pytest), the phases outside tests per
process (worker starts while collecting) and the slowest tests. ``--json PATH`` writes the
per-test details. Everything after ``--`` goes to pytest:

    PYTHONPATH=src python -m benchmarks.bench_gpu_phases --json phases.json -- -m gpu -n 8
    PYTHONPATH=src python -m benchmarks.bench_gpu_phases --stop-after 300 -- -m gpu -n 16
    PYTHONPATH=src python -m benchmarks.bench_gpu_phases -- -m cpu -n 2 \\
        src/attention_crossval/properties/test_kernels.py -k streaming
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from attention_crossval.kernel.harness.phases import PHASES
from benchmarks.machine import cpu_model

UNATTRIBUTED = "unattributed"


def gpu_names() -> str:
    """The GPUs ``nvidia-smi -L`` lists (no CUDA context is made here), or ``no GPU``."""
    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    listing = subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    names = [line.split(":", 1)[1].split("(UUID")[0].strip() for line in listing.splitlines()]
    return ", ".join(names) or "no GPU"


def run_pytest(
    pytest_args: list[str], timings: Path, stop_after: float | None
) -> tuple[int, float]:
    """Run pytest with ``--phase-timings``; its exit code and wall seconds. Interrupted (Ctrl-C,
    or ``stop_after`` seconds passed), pytest gets SIGINT itself and still writes the timings of
    the tests that finished, as a user's Ctrl-C gives it."""
    command = [sys.executable, "-m", "pytest", *pytest_args, f"--phase-timings={timings}"]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command)
    try:
        process.wait(timeout=stop_after)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        print(f"\ninterrupting pytest after {time.perf_counter() - start:.0f} s", flush=True)
        process.send_signal(signal.SIGINT)
        process.wait()
    return process.returncode, time.perf_counter() - start


def per_kernel(tests: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Kernel -> phase -> [seconds, calls] over its tests, ``unattributed`` the rest of their
    seconds; tests without a kernel parameter under ``-``."""
    kernels: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for test in tests:
        table = kernels[test["kernel"] or "-"]
        for name, (seconds, calls) in test["phases"].items():
            table[name][0] += seconds
            table[name][1] += calls
        rest = test["seconds"] - sum(seconds for seconds, _ in test["phases"].values())
        table[UNATTRIBUTED][0] += max(rest, 0.0)
        table[UNATTRIBUTED][1] += 1
    return kernels


def phase_rows(phases: dict[str, list[float]]) -> list[str]:
    """One line per phase (in :data:`PHASES` order, then any other), with its share."""
    total = sum(seconds for seconds, _ in phases.values()) or 1.0
    order = [*PHASES, UNATTRIBUTED]
    names = sorted(phases, key=lambda n: (order.index(n) if n in order else len(order), n))
    return [
        f"  {name:<28} {phases[name][0]:>9.2f} {100 * phases[name][0] / total:>6.1f}% "
        f"{int(phases[name][1]):>7}"
        for name in names
    ]


def report(timings: dict, wall: float, code: int, pytest_args: list[str]) -> None:
    print(f"\nmachine: {cpu_model()}, {os.cpu_count()} cores; GPU: {gpu_names()}")
    print(f"pytest {' '.join(pytest_args)}: exit {code}, wall {wall:.1f} s")
    tests = timings["tests"]
    outcomes = defaultdict(int)
    for test in tests:
        outcomes[test["outcome"]] += 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
    print(f"{len(tests)} tests ({summary}); xdist workers: {timings['xdist_workers'] or 'none'}")
    header = f"  {'phase':<28} {'seconds':>9} {'share':>7} {'calls':>7}"
    for kernel, phases in sorted(per_kernel(tests).items()):
        count = sum(1 for t in tests if (t["kernel"] or "-") == kernel)
        seconds = sum(t["seconds"] for t in tests if (t["kernel"] or "-") == kernel)
        print(f"\n{kernel}: {count} tests, {seconds:.1f} s of test time")
        print(header)
        print("\n".join(phase_rows(phases)))
    print("\noutside tests, per process (collect: while collecting; between: module teardowns)")
    for process in timings["processes"]:
        collection = process["collection_s"] or 0.0
        print(f"  {process['process']}: collection {collection:.1f} s")
        print("\n".join(phase_rows(process["phases"])) if process["phases"] else "  (none)")
    print("\nslowest tests")
    for test in sorted(tests, key=lambda t: -t["seconds"])[:10]:
        print(f"  {test['seconds']:>8.1f} s  {test['nodeid']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the per-test details here")
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="interrupt pytest after this many seconds and report the tests that finished",
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's")
    args = parser.parse_args()
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "phases.json"
        code, wall = run_pytest(pytest_args, path, args.stop_after)
        if not path.exists():
            sys.exit(f"pytest wrote no phase timings (exit {code}): did it collect any test?")
        timings = json.loads(path.read_text())
    report(timings, wall, code, pytest_args)
    if args.json:
        details = timings | {
            "wall_s": wall,
            "exit_code": code,
            "pytest_args": pytest_args,
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu_names()},
        }
        Path(args.json).write_text(json.dumps(details, indent=1))


if __name__ == "__main__":
    main()
