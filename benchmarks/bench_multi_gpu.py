"""Scaling over the GPUs of one node: checked cases per minute on 1 GPU vs all N, same case set.

It refuses to start with fewer than 2 GPUs. ``--counts`` picks which runs to make (``1``,
``all`` or both), so that a workload too long for one command can be timed in two; the speedup
column then needs both rows of one invocation.

Two workloads, each timed cold (fresh output folder, so no exact-tier cache is reused):

* ``report``: ``attention-report --preset P --kernel K ... --gpus ID`` and ``--gpus ID,ID,...``;
  checked cases = records in the merged report.json (the same configs either way: sharding only
  splits them).
* ``pytest``: ``CI=true pytest -m gpu -n 1`` with one GPU visible vs ``-n N`` with all N
  (``kernel.harness.gpu_workers`` pins one GPU per xdist worker; the ci Hypothesis profile seeds
  every
  run from the git commit, so both runs draw the same cases); checked cases = passed tests
  (junit XML).

    python benchmarks/bench_multi_gpu.py --gpus all --preset gpu-small --kernel sdpa-flash
    python benchmarks/bench_multi_gpu.py --only pytest
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from attention_crossval.report.shard import parse_gpus

ROOT = Path(__file__).resolve().parents[1]


def _report_run(gpus: list[str], args: argparse.Namespace, work: Path) -> tuple[int, float]:
    out = work / f"report-{len(gpus)}gpu"
    shutil.rmtree(out, ignore_errors=True)
    kernels = [part for name in args.kernel for part in ("--kernel", name)]
    command = [sys.executable, "-m", "attention_crossval.report", "--preset", args.preset, *kernels]
    command += ["--gpus", ",".join(gpus), "--out", str(out), "--no-html", "--no-progress"]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.perf_counter() - start
    return json.loads((out / "report.json").read_text())["summary"]["records"], wall


def _pytest_run(gpus: list[str], args: argparse.Namespace, work: Path) -> tuple[int, float]:
    xml = work / f"pytest-{len(gpus)}gpu.xml"
    env = {**os.environ, "CI": "true", "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", str(len(gpus)), "-q", "-p"]
    command += ["xdist", f"--junitxml={xml}", *args.pytest_arg]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=False)  # failures still count the rest
    wall = time.perf_counter() - start
    cases = ET.parse(xml).getroot().iter("testcase")
    passed = sum(1 for case in cases if not any(child.tag in _NOT_PASSED for child in case))
    return passed, wall


_NOT_PASSED = {"failure", "error", "skipped"}
_COUNT_SLICES = {"1": (0, 1), "all": (1, 2), "1,all": (0, 2)}
_WORKLOADS = {"report": _report_run, "pytest": _pytest_run}


def _machine(gpus: list[str]) -> str:
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    names = (
        subprocess.run(query, capture_output=True, text=True, check=False).stdout.split("\n")
        if shutil.which("nvidia-smi")
        else []
    )
    chosen = {n.strip() for i, n in enumerate(names) if str(i) in gpus and n.strip()}
    return (
        f"{platform.node()}: {len(gpus)} x {', '.join(sorted(chosen)) or 'GPU'} "
        f"(ids {','.join(gpus)}), {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="all", help="all or ID,ID,... (default all)")
    parser.add_argument("--only", choices=sorted(_WORKLOADS), help="one workload (default both)")
    parser.add_argument("--preset", default="gpu-small", help="report preset (default gpu-small)")
    parser.add_argument(
        "--kernel", action="append", default=[], help="report kernel, repeatable (sdpa-flash)"
    )
    parser.add_argument(
        "--pytest-arg", action="append", default=[], help="extra pytest argument, repeatable"
    )
    parser.add_argument(
        "--counts", choices=("1", "all", "1,all"), default="1,all", help="GPU counts to time"
    )
    parser.add_argument("--work", help="folder for outputs (default: a temporary one)")
    args = parser.parse_args()
    args.kernel = args.kernel or ["sdpa-flash"]
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError:  # no GPU at all: the same refusal as one GPU
        gpus = []
    if len(gpus) < 2:
        raise SystemExit(
            f"bench_multi_gpu: needs >= 2 GPUs to compare 1 vs N, found {len(gpus)} "
            f"({gpus or 'none'}; --gpus={args.gpus!r})"
        )
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_multi_gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [args.only] if args.only else sorted(_WORKLOADS):
        for chosen in [[gpus[0]], gpus][slice(*_COUNT_SLICES[args.counts])]:
            cases, wall = _WORKLOADS[name](chosen, args, work)
            rows.append((name, len(chosen), cases, wall, 60.0 * cases / wall))
    print(_machine(gpus))
    what = f"report: --preset {args.preset} --kernel {' --kernel '.join(args.kernel)}"
    print(f"{what}; pytest: -m gpu {' '.join(args.pytest_arg)}; outputs in {work}")
    header = ("workload", "GPUs", "cases", "wall s", "cases/min", "speedup")
    print("{:<8} {:>4} {:>7} {:>8} {:>10} {:>8}".format(*header))
    for name, count, cases, wall, rate in rows:
        base = next((r[4] for r in rows if r[0] == name and r[1] == 1), None)
        speedup = f"{rate / base:.2f}x" if base else "-"  # no 1-GPU row, or nothing passed
        print(f"{name:<8} {count:>4} {cases:>7} {wall:>8.1f} {rate:>10.1f} {speedup:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
