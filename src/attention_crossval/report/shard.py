"""Shard a report's configurations over processes (one per GPU) and merge the shards' reports.

* ``--shard K/N`` runs configuration ``i`` (in the configuration set's own, deterministic order)
  iff ``i % N == K``; the shard's ``report.json`` carries a ``shard`` entry (K, N and the
  ``CUDA_VISIBLE_DEVICES`` its process saw) and its ``records.jsonl`` resumes like any run.
* ``--shard auto[/N]`` takes K from a scheduler's environment (a Slurm job array's task, a
  Kubernetes Indexed Job's completion index) and writes to ``OUT/shard-K-of-N``, so every task
  of a campaign gets the same command line (docs/campaigns.md).
* ``--gpus all|ID,ID,...`` starts one ``attention-report`` child per GPU with
  ``CUDA_VISIBLE_DEVICES`` pinned and ``--shard K/N``, each writing to ``OUT/shard-K-of-N``,
  then merges them into ``OUT``. The ids only go into ``CUDA_VISIBLE_DEVICES``; ``all`` lists
  them as ``kernel.harness.gpu_workers.visible_gpus`` does for ``pytest -m gpu -n N``.
* ``attention-report merge OUT SHARD...`` merges shard reports: records deduplicated by key,
  a key with two different results refused, records in the unsharded order, schema-checked.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from attention_crossval.report.schema import SCHEMA_VERSION, validate
from attention_crossval.report.session import read_report, summarize, write_outputs

_CHILD_LOG = "shard.log"


AUTO = "auto"
SLURM_TASK_ID = "SLURM_ARRAY_TASK_ID"
SLURM_TASK_MIN = "SLURM_ARRAY_TASK_MIN"
SLURM_TASK_STEP = "SLURM_ARRAY_TASK_STEP"
SLURM_TASK_COUNT = "SLURM_ARRAY_TASK_COUNT"
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
_SHARD_RULE = "must be K/N with integers 0 <= K < N, or auto[/N] (K from the scheduler)"


class Shard(NamedTuple):
    """Shard ``index`` of ``count``; ``variable``: the environment variable the index came from
    (``--shard auto``), None when given as ``K/N``."""

    index: int
    count: int
    variable: str | None = None

    def folder(self, out: str | Path) -> Path:
        """Where the shard writes: ``out`` itself for ``K/N``, ``OUT/shard-K-of-N`` for ``auto``
        (every task of a campaign shares one ``--out`` root)."""
        return shard_dir(out, self.index, self.count) if self.variable else Path(out)


def parse_shard(text: str, environ: Mapping[str, str] = os.environ) -> Shard:
    """``"K/N"`` -> ``Shard(K, N)`` with ``0 <= K < N``; ``"auto"`` / ``"auto/N"``: K (and N
    when left out) from ``environ`` (:func:`shard_from_environment`)."""
    index, slash, count = text.partition("/")
    if index.strip() == AUTO:
        total = _natural(count) if slash else None
        if slash and not total:
            raise ValueError(f"--shard={text!r} {_SHARD_RULE}")
        return shard_from_environment(total, environ)
    k, n = _natural(index), _natural(count)
    if k is None or not n or k >= n:
        raise ValueError(f"--shard={text!r} {_SHARD_RULE}")
    return Shard(k, n)


def shard_from_environment(count: int | None, environ: Mapping[str, str] = os.environ) -> Shard:
    """The shard of this task of a Slurm job array (``SLURM_ARRAY_TASK_ID`` counted from
    ``SLURM_ARRAY_TASK_MIN`` in steps of ``SLURM_ARRAY_TASK_STEP``, so ``--array=1-N`` and
    ``--array=0-(N-1)`` both give shards 0..N-1; N defaults to ``SLURM_ARRAY_TASK_COUNT``) or of
    a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX``; N must be given: the pod does not see
    ``completions``). ValueError naming the variable that is missing, malformed or out of range."""
    slurm, indexed = SLURM_TASK_ID in environ, JOB_COMPLETION_INDEX in environ
    if slurm == indexed:
        which = "both are set: unset one" if slurm else "neither is set"
        raise ValueError(
            f"--shard auto takes K from {SLURM_TASK_ID} (Slurm job array) or "
            f"{JOB_COMPLETION_INDEX} (Kubernetes Indexed Job); {which}, or give --shard K/N"
        )
    if indexed:
        if count is None:
            raise ValueError(
                f"--shard auto with {JOB_COMPLETION_INDEX} needs the shard count: --shard auto/N "
                "with N the Indexed Job's completions"
            )
        variable, index = JOB_COMPLETION_INDEX, _environment_int(environ, JOB_COMPLETION_INDEX)
        where = f"{variable}={index}"
    else:
        task = _environment_int(environ, SLURM_TASK_ID)
        first = _environment_int(environ, SLURM_TASK_MIN)
        step = _environment_int(environ, SLURM_TASK_STEP) if SLURM_TASK_STEP in environ else 1
        tasks = _environment_int(environ, SLURM_TASK_COUNT) if SLURM_TASK_COUNT in environ else None
        if count is None and not tasks:
            got = "is not set" if tasks is None else "is 0"
            raise ValueError(f"--shard auto: {SLURM_TASK_COUNT} {got}; give N: --shard auto/N")
        if count is not None and tasks is not None and tasks != count:
            raise ValueError(
                f"--shard auto/{count}: {SLURM_TASK_COUNT}={tasks} differs; submit the array "
                f"with {count} tasks (sbatch --array=0-{count - 1})"
            )
        count = count if count is not None else tasks
        variable, where = SLURM_TASK_ID, f"{SLURM_TASK_ID}={task} ({SLURM_TASK_MIN}={first}"
        where += f", {SLURM_TASK_STEP}={step})"
        if step < 1 or task < first or (task - first) % step:
            raise ValueError(f"--shard auto: {where} is not a task of a contiguous array")
        index = (task - first) // step
    if index >= count:
        raise ValueError(
            f"--shard auto/{count}: {where} gives shard {index}, outside 0..{count - 1}"
        )
    return Shard(index, count, variable)


def _environment_int(environ: Mapping[str, str], name: str) -> int:
    value = _natural(environ.get(name, ""))
    if value is None:
        got = f"{name} is not set" if name not in environ else f"{name}={environ[name]!r}"
        raise ValueError(f"--shard auto: {got}; it must be an integer >= 0")
    return value


def _natural(text: str) -> int | None:
    """``text`` as an integer >= 0 (ASCII digits, surrounding blanks allowed), else None."""
    return int(text) if re.fullmatch(r"\s*[0-9]+\s*", text) else None


def shard_configs(configs: Sequence, index: int, count: int) -> list:
    """The configurations of shard ``index`` of ``count``: every ``count``-th from ``index``."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index}/{count} must satisfy 0 <= index < count")
    return [config for i, config in enumerate(configs) if i % count == index]


def shard_provenance(index: int, count: int) -> dict:
    """The ``shard`` entry of a shard's report (what a merge needs to restore the order)."""
    return {
        "index": index,
        "count": count,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def parse_gpus(text: str) -> list[str]:
    """``all`` -> the GPUs this process may use; else the comma-separated ids, in order."""
    from attention_crossval.kernel.harness.gpu_workers import visible_gpus

    gpus = visible_gpus() if text == "all" else [g.strip() for g in text.split(",") if g.strip()]
    if not gpus:
        where = "CUDA_VISIBLE_DEVICES is empty or nvidia-smi lists none" if text == "all" else ""
        raise ValueError(f"--gpus={text!r} names no GPU{' (' + where + ')' if where else ''}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus={text!r} must not repeat a GPU")
    return gpus


def shard_dir(out: str | Path, index: int, count: int) -> Path:
    return Path(out) / f"shard-{index}-of-{count}"


def _child_argv(argv: Sequence[str], out: Path, index: int, count: int) -> list[str]:
    """The parent's arguments without ``--gpus``; ``--out`` and ``--shard`` appended (argparse
    keeps the last occurrence). An abbreviated ``--gpus`` that slips through makes the child
    refuse ``--gpus`` with ``--shard``, never recurse."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            kept.append(arg)
    return [*kept, "--out", str(out), "--shard", f"{index}/{count}", "--no-progress"]


def run_on_gpus(
    argv: Sequence[str], gpus: Sequence[str], out: str | Path, *, html: bool = True
) -> dict:
    """One ``attention-report`` child per GPU (pinned with ``CUDA_VISIBLE_DEVICES``), then the
    merged report in ``out``. Children log to ``OUT/shard-K-of-N/shard.log``."""
    out = Path(out)
    count = len(gpus)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding attention_crossval
    start = time.perf_counter()
    children = []
    for index, gpu in enumerate(gpus):
        folder = shard_dir(out, index, count)
        folder.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONPATH": path}
        log = (folder / _CHILD_LOG).open("w")
        command = [
            sys.executable,
            "-m",
            "attention_crossval.report",
            *_child_argv(argv, folder, index, count),
        ]
        children.append((folder, log, subprocess.Popen(command, env=env, stdout=log, stderr=log)))
        print(f"attention-report: shard {index}/{count} on CUDA_VISIBLE_DEVICES={gpu} -> {folder}/")
    failed = []
    for folder, log, child in children:
        code = child.wait()
        log.close()
        if code not in (0, 1):  # 1: records failed, the shard's report is complete
            tail = (folder / _CHILD_LOG).read_text().strip().splitlines()[-3:]
            failed.append(f"{folder} exit {code}: {' | '.join(tail)}")
    if failed:
        raise ValueError("shard(s) failed, nothing merged: " + "; ".join(failed))
    command = ["attention-report", *argv]
    sources = [folder for folder, _, _ in children]
    return merge_reports(
        sources, out, html=html, command=command, elapsed_s=time.perf_counter() - start
    )


def load_shard(source: str | Path) -> tuple[Path, dict]:
    """A shard's ``report.json`` (given it or its folder), schema-checked."""
    path = Path(source)
    if path.is_dir():
        path = path / "report.json"
    report = read_report(path)
    if "shard" not in report:
        raise ValueError(f"{path} is not a shard report (no 'shard' entry: run with --shard K/N)")
    return path, report


def merge_reports(
    sources: Sequence[str | Path],
    out: str | Path,
    *,
    html: bool = True,
    command: Sequence[str] | None = None,
    elapsed_s: float | None = None,
) -> dict:
    """Merge shard reports into ``out``: records deduplicated by key (a key whose results differ
    beyond timing is refused), ordered as the unsharded run orders them. ``elapsed_s`` defaults
    to the slowest shard's (shards run side by side)."""
    if not sources:
        raise ValueError("merge needs at least one shard report")
    shards = [load_shard(source) for source in sources]
    first = shards[0][1]
    count = first["shard"]["count"]
    for path, report in shards:
        for field in ("options", "kernels"):
            if report[field] != first[field]:
                raise ValueError(f"{path} {field}={report[field]} differs from {first[field]}")
        if report["shard"]["count"] != count:
            raise ValueError(f"{path} is shard of {report['shard']['count']}, others of {count}")
    missing = sorted(set(range(count)) - {report["shard"]["index"] for _, report in shards})
    if missing:
        raise ValueError(f"shards {missing} of {count} missing: a merge would lose their records")
    kernels = first["kernels"]
    merged: dict[str, tuple[tuple[int, int], dict, Path]] = {}
    for path, report in shards:
        configs: dict[str, int] = {}
        for record in report["records"]:
            config = record["key"].rsplit("|", 2)[0]  # config name|digest
            local = configs.setdefault(config, len(configs))
            kernel = kernels.index(record["kernel"]["name"])
            order = (report["shard"]["index"] + local * count, kernel)
            seen = merged.get(record["key"])
            if seen is not None and _result(seen[1]) != _result(record):
                raise ValueError(
                    f"record {record['key']!r} differs between {seen[2]} and {path}: "
                    f"verdicts {seen[1]['verdict']} / {record['verdict']}"
                )
            merged.setdefault(record["key"], (order, record, path))
    records = [record for _, record, _ in sorted(merged.values(), key=lambda item: item[0])]
    report = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else sys.argv,
        "machine": first["machine"],
        "options": first["options"],
        "kernels": kernels,
        "elapsed_s": round(
            elapsed_s if elapsed_s is not None else max(r.get("elapsed_s", 0.0) for _, r in shards),
            3,
        ),
        "resumed_records": sum(r.get("resumed_records", 0) for _, r in shards),
        "exact_cache": {
            key: sum(r.get("exact_cache", {}).get(key, 0) for _, r in shards)
            for key in ("hits", "misses")
        },
        "summary": summarize(records),
        "shards": [
            {
                **r["shard"],
                "source": str(path),
                "records": len(r["records"]),
                "elapsed_s": r.get("elapsed_s", 0.0),
                "gpu": r["machine"].get("gpu"),
            }
            for path, r in shards
        ],
        "records": records,
    }
    validate(report)
    Path(out).mkdir(parents=True, exist_ok=True)
    write_outputs(report, Path(out), html=html)
    return report


def _result(record: dict) -> dict:
    """A record without its timings: two runs of one key must agree on everything else."""
    return {key: value for key, value in record.items() if key != "timing"}
