"""One report run: resolve kernels, evaluate configs with resume, write JSON/Markdown/HTML.

Files under the output directory:

* ``records.jsonl``: one line per finished (config, kernel), appended as it finishes; a rerun
  with the same configs, kernels and options skips the keys already there.
* ``cache/exact/*.npz``: exact-tier results (:mod:`report.cache`).
* ``report.json`` (schema: report/schema.json), ``report.md``, ``report.html`` (needs
  matplotlib; without it the run still writes JSON and Markdown and says so).
* ``.attention-report.lock``: held (``flock``) by the run writing here, so a second run into the
  same directory is refused instead of duplicating the work and the records.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import platform
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from attention_crossval.report.cache import ExactCache
from attention_crossval.report.grid_classes import tally
from attention_crossval.report.records import RecordLog, parse_json
from attention_crossval.report.runner import Kernel, RunOptions, evaluate, record_key
from attention_crossval.report.schema import SCHEMA_VERSION, validate

LOCK_NAME = ".attention-report.lock"
_OUTPUTS = ("records.jsonl", "report.json", "report.md", "report.html")


def resolve_kernels(
    names: Sequence[str],
    *,
    isolate: str = "auto",
    timeout_s: float = 300.0,
    start_timeout_s: float = 600.0,
) -> list[Kernel]:
    """A :class:`~report.runner.Kernel` per built-in name or dotted path, in order.

    ``isolate``: ``auto`` runs every kernel in an isolated worker process (its module and
    factory included: a crash or hang is a finding and a fresh worker continues), except the
    built-ins of ``kernel.harness.registry.IN_PROCESS``; ``always`` isolates those too; ``never``
    runs
    every kernel in this process. A kernel whose worker cannot start raises ValueError.
    """
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.kernel.harness.registry import IN_PROCESS, resolve

    if len(set(names)) != len(names):
        raise ValueError(f"kernels={list(names)} must not repeat a kernel")
    if isolate not in ("auto", "always", "never"):
        raise ValueError(f"isolate={isolate!r} must be 'auto', 'always' or 'never'")
    kernels: list[Kernel] = []
    try:
        for name in names:
            if isolate == "never" or (isolate == "auto" and name in IN_PROCESS):
                kernels.append(Kernel(name, resolve(name)))
                continue
            worker = IsolatedKernel(name, timeout_s, start_timeout_s)
            kernels.append(Kernel(name, worker, worker))
            worker.start()
    except ValueError:
        close_kernels(kernels)
        raise
    return kernels


def close_kernels(kernels: Sequence[Kernel]) -> None:
    """Stop the kernels' worker processes."""
    for kernel in kernels:
        if kernel.isolated is not None:
            kernel.isolated.close()


@contextlib.contextmanager
def output_lock(out_dir: str | Path) -> Iterator[Path]:
    """Hold ``OUT/.attention-report.lock`` (``flock``) for the block; ValueError naming the
    holder's pid when another run writes into ``out_dir``. The lock ends with the process."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ValueError(
                f"--out {out} is in use by another attention-report run (pid {holder}); "
                "wait for it or choose another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield out


def clear_outputs(out_dir: str | Path) -> None:
    """Forget finished work in ``out_dir`` (``--fresh``): records, reports and the exact cache."""
    out = Path(out_dir)
    for name in _OUTPUTS:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "cache", ignore_errors=True)


def run_report(
    configs: Sequence,
    kernels: Sequence[Kernel],
    options: RunOptions,
    out_dir: str | Path,
    *,
    progress: bool = True,
    html: bool = True,
    command: Sequence[str] | None = None,
    provenance: dict | None = None,
) -> dict:
    """Evaluate every (config, kernel) not yet in ``out_dir``, then write the final outputs
    (``html=False``: JSON and Markdown only). Returns the report (``report.json``'s content).
    ``provenance``: extra top-level fields (a shard's ``shard`` entry, :mod:`report.shard`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = RecordLog(out / "records.jsonl")
    done = log.load()
    cache = ExactCache(out / "cache" / "exact")
    start = time.perf_counter()
    reused = 0
    bar = _progress(len(configs) * len(kernels), progress)
    try:
        for config in configs:
            todo = [k for k in kernels if record_key(config, k.name, options) not in done]
            reused += len(kernels) - len(todo)
            bar.update(len(kernels) - len(todo))
            if not todo:
                continue
            bar.set_postfix_str(config.name)
            for record in evaluate(config, todo, options, cache):
                log.append([record])
                done[record["key"]] = record
                bar.update(1)
    finally:
        bar.close()
        close_kernels(kernels)
    records = [done[record_key(c, k.name, options)] for c in configs for k in kernels]
    report = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else sys.argv,
        "machine": machine_info(any(k.spec.device == "cuda" for k in kernels)),
        "options": {**vars(options), "tiers": list(options.tiers)},
        "kernels": [k.name for k in kernels],
        "elapsed_s": round(time.perf_counter() - start, 3),
        "resumed_records": reused,
        "exact_cache": {"hits": cache.hits, "misses": cache.misses},
        "summary": summarize(records),
        "input_classes": tally(configs),
        **(provenance or {}),
        "records": records,
    }
    validate(report)
    write_outputs(report, out, html=html)
    return report


def read_report(path: str | Path) -> dict:
    """A ``report.json``, parsed and checked against the schema; any error names the file."""
    path = Path(path)
    try:
        report = parse_json(path.read_text(), "the file")
        validate(report)
    except ValueError as error:  # not JSON (line and column), too deep, or a schema violation
        raise ValueError(f"{path}: {error}") from None
    return report


def summarize(records: Sequence[dict]) -> dict:
    """The report's ``summary``: record count and verdict counts."""
    return {"records": len(records), "verdicts": dict(Counter(r["verdict"] for r in records))}


def write_outputs(report: dict, out: Path, *, html: bool = True) -> list[Path]:
    """report.json, report.md and (with ``html`` and matplotlib) report.html; returns the paths
    written."""
    from attention_crossval.report.markdown import render_markdown

    paths = [_write(out / "report.json", json.dumps(report, indent=1, allow_nan=False))]
    paths.append(_write(out / "report.md", render_markdown(report)))
    stale = out / "report.html"
    if not html:
        stale.unlink(missing_ok=True)  # never leave a page that disagrees with report.json
        return paths
    try:
        from attention_crossval.report.html import render_html
    except ImportError as error:
        stale.unlink(missing_ok=True)
        print(f"attention-report: no HTML page ({error}); wrote JSON and Markdown", file=sys.stderr)
        return paths
    paths.append(_write(out / "report.html", render_html(report)))
    return paths


def _write(path: Path, text: str) -> Path:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
    return path


def machine_info(probe_gpu: bool) -> dict:
    """Where the numbers come from. torch is imported only when a CUDA kernel ran."""
    import mpmath

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpmath": f"{mpmath.__version__} ({mpmath.libmp.BACKEND})",
        "cpu_count": os.cpu_count(),
        "gpu": None,
        "torch": None,
    }
    if probe_gpu:
        try:
            import torch
        except ImportError:
            return info
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", desc="attention-report", dynamic_ncols=True)
