"""What the benchmarks print to name the machine a table was measured on."""

from __future__ import annotations

import platform
from pathlib import Path

from threadpoolctl import threadpool_info


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def blas_threads() -> int | str:
    """The threads numpy's BLAS runs on now (threadpoolctl: the benchmarks hold it to one)."""
    counts = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts) if counts else "no BLAS found"
