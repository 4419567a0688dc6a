"""How long the pytest route's kernel suite takes to fail a kernel that crashes, exits, hangs or
raises KeyboardInterrupt.

Run from the repository root: ``python -m benchmarks.bench_faults --timeout 5``. For each fault
kernel of ``testing/broken/cpu_exits.py`` it runs, in a fresh directory, what a user runs::

    pytest --pyargs attention_crossval.properties -m kernel --kernel <fault kernel>
           --hypothesis-profile=ci [--kernel-timeout T]

(``--kernel-timeout`` for the hanging kernel only; the others keep the default 300 s) and prints
a Markdown table: wall seconds, tests failed (passed, skipped), kernel calls (each call appends a
line to ``$CPU_FAULTS_CALL_LOG``), and the first finding the failures name. Before the table it
times a worker's first start and its restarts after a crash (``--restarts`` of them).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from threadpoolctl import threadpool_limits

from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
MODULE = "attention_crossval.testing.broken.cpu_exits"
FAULTS = {
    "segfault": "reads address 0 (SIGSEGV)",
    "sys_exit": "sys.exit(0)",
    "exit0": "os._exit(0)",
    "hang": "sleeps an hour",
    "interrupt": "raises KeyboardInterrupt",
}
_FINDING = re.compile(r"\b(crash|timeout|error): [^\n]*")
_OUTCOME = re.compile(r"(\d+) (failed|passed|skipped|error|errors)\b")


def run_suite(fault: str, timeout_s: float, limit_s: float) -> dict[str, object]:
    """The kernel suite on ``fault``'s kernel in a fresh directory: its wall time, outcomes,
    kernel calls and first finding."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "calls.log"
        python_path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "PYTHONPATH": python_path, "CPU_FAULTS_CALL_LOG": str(log)}
        env["ATTENTION_REPORT_DIR"] = str(Path(scratch) / "cases")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
        command += ["-p", "attention_crossval.pytest_plugin", "--hypothesis-profile=ci"]
        command += ["--pyargs", "attention_crossval.properties", "-m", "kernel", "-q"]
        command += [f"--kernel={MODULE}:{fault}"]
        if fault == "hang":
            command += [f"--kernel-timeout={timeout_s:g}"]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=scratch, env=env, capture_output=True, text=True, timeout=limit_s
            )
            output, finished = done.stdout + done.stderr, True
        except subprocess.TimeoutExpired as expired:
            output, finished = str(expired.stdout or ""), False
        seconds = time.perf_counter() - start
        calls = len(log.read_text().split()) if log.exists() else 0
    outcomes = {kind.rstrip("s"): int(n) for n, kind in _OUTCOME.findall(output.splitlines()[-1])}
    finding = _FINDING.search(output)
    return {
        "seconds": seconds,
        "finished": finished,
        "failed": outcomes.get("failed", 0),
        "passed": outcomes.get("passed", 0),
        "skipped": outcomes.get("skipped", 0),
        "calls": calls,
        "finding": finding.group(0) if finding else "(none)",
    }


def restart_seconds(restarts: int) -> list[float]:
    """Seconds to start ``cpu_exits:segfault``'s worker, first and after each crash."""
    import numpy as np

    from attention_crossval.kernel.harness.execution import KernelCrashed
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.reference.case import AttentionCase

    rng = np.random.default_rng(0)
    case = AttentionCase(*(rng.standard_normal((1, 4, 1, 8)).astype(np.float16) for _ in "qkv"))
    worker = IsolatedKernel(f"{MODULE}:segfault")
    seconds = []
    try:
        for _ in range(restarts + 1):
            start = time.perf_counter()
            worker.start()
            seconds.append(time.perf_counter() - start)
            try:
                worker(case)
            except KernelCrashed:
                pass
    finally:
        worker.close(kill=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="--kernel-timeout for hang")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per suite run")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--restarts", type=int, default=4, help="worker restarts to time")
    args = parser.parse_args()
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    first, *restarts = restart_seconds(args.restarts)
    shown = ", ".join(f"{s:.2f}" for s in restarts)
    print(f"worker start: first {first:.2f} s (with the fork server's), restarts {shown} s")
    print()
    print("| fault | kernel does | wall s | failed / passed / skipped | kernel calls | finding |")
    print("|---|---|---:|---:|---:|---|")
    for fault in args.faults:
        row = run_suite(fault, args.timeout, args.limit)
        wall = f"{row['seconds']:.1f}" + ("" if row["finished"] else " (limit)")
        finding = str(row["finding"]).replace("|", "\\|")
        print(
            f"| {fault} | {FAULTS[fault]} | {wall} | {row['failed']} / {row['passed']} / "
            f"{row['skipped']} | "
            f"{row['calls']} | `{finding}` |",
            flush=True,
        )


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
