"""How many generated cases per minute the defensive suite checks, per built-in GPU adapter.

Each (kernel, shard) runs in its own process with its own isolated kernel worker, drawing cases
and checking every one: ``--pass forward`` (default) draws ``attention_cases(spec=...)`` for
``run_case`` (defensive checks plus the bound against float64 on all rows and exact on sampled
rows); ``--pass backward`` draws ``backward_cases(spec=...)`` for ``run_backward_case``
(poisoned padding, prefill and guards where the adapter allows, determinism, dq/dk/dv against
float64 on every element and exact on sampled rows and keys) and adds the run-to-run column.
Cases run through ``run_with_known`` / ``run_backward_with_known``: a case whose failures are
all declared known findings counts as ``known``, and only the other failures are spelled out.
Prints one table naming the GPU; ``--json`` writes every verdict's findings.

    python benchmarks/bench_gpu_suite.py --minutes 8 --shards 3 --json out.json
    python benchmarks/bench_gpu_suite.py --pass backward --minutes 3 --shards 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor


class _TimeUp(Exception):
    """Ends Hypothesis' generation once the shard's time is spent."""


def _one_blas_thread() -> None:
    """In each shard process, before NumPy loads there: one BLAS thread (the references' small
    GEMMs, docs/numerics.md#small-gemms)."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def _shard(
    kernel: str, shard: int, seconds: float, max_len: int, finding_dir: str | None, backward: bool
) -> dict:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.kernel.harness.known import (
        covering,
        run_backward_with_known,
        run_with_known,
    )
    from attention_crossval.properties.strategies import attention_cases, backward_cases

    worker = IsolatedKernel(kernel, timeout_s=120.0)
    if backward and not worker.spec.backward:
        worker.close()
        return {"kernel": kernel, "shard": shard, "elapsed": 0.0, "verdicts": [], "absent": True}
    deadline = time.monotonic() + seconds
    verdicts: list[dict] = []
    cases, run = (
        (backward_cases, run_backward_with_known) if backward else (attention_cases, run_with_known)
    )
    strategy = cases(spec=worker.spec, max_len=min(max_len, 4 * worker.spec.tile_n + 1))

    @seed((2000 if backward else 1000) + shard)
    @settings(
        max_examples=100_000,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def loop(case):
        if time.monotonic() > deadline:
            raise _TimeUp
        verdict = run(worker, case, finding_dir=finding_dir)
        run_to_run = getattr(verdict, "run_to_run", None)  # the backward's run-to-run summary
        forward = case.forward if backward else case
        known = covering(worker.spec, forward, verdict.findings, backward=backward)
        verdicts.append(
            {
                "case": verdict.case,
                "skipped": verdict.skipped,
                "findings": [[f.check, f.message[:2000], f.case_path] for f in verdict.findings],
                "declared": list(verdict.declared),
                "known": bool(known),
                "differing": None if run_to_run is None else run_to_run.differing,
                "seconds": verdict.seconds,
            }
        )

    start = time.monotonic()
    try:
        loop()
    except _TimeUp:
        pass
    finally:
        worker.close()
    return {
        "kernel": kernel,
        "shard": shard,
        "elapsed": time.monotonic() - start,
        "verdicts": verdicts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernel", action="append", default=[], help="name or dotted path; repeatable"
    )
    parser.add_argument("--pass", dest="passes", choices=("forward", "backward"), default="forward")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall time per shard")
    parser.add_argument("--shards", type=int, default=2, help="processes per kernel")
    parser.add_argument("--max-len", type=int, default=1 << 10)
    parser.add_argument("--json", default=None, help="write every verdict here")
    parser.add_argument("--finding-dir", default=None, help="save failing cases (.npz) here")
    args = parser.parse_args()

    from attention_crossval.kernel.harness.registry import default_kernels

    backward = args.passes == "backward"
    kernels = args.kernel or default_kernels(has_gpu=True, backward=backward)
    gpu = _gpu_name()
    jobs = [(k, s) for k in kernels for s in range(args.shards)]
    with ProcessPoolExecutor(
        max_workers=len(jobs),
        mp_context=__import__("multiprocessing").get_context("spawn"),
        initializer=_one_blas_thread,
    ) as pool:
        futures = [
            pool.submit(_shard, k, s, args.minutes * 60, args.max_len, args.finding_dir, backward)
            for k, s in jobs
        ]
        results = [f.result() for f in futures]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"gpu": gpu, "results": results}, handle, indent=1)
    _table(gpu, kernels, results, args.minutes, backward)


def _gpu_name() -> str:
    try:
        import torch
    except ImportError:
        return "no GPU (torch missing)"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def _table(
    gpu: str, kernels: list[str], results: list[dict], minutes: float, backward: bool
) -> None:
    checks = (
        "backward: defensive + dq/dk/dv bound (float64 every element, exact on sampled rows, keys)"
        if backward
        else "defensive + bound (float64 all rows, exact on sampled rows)"
    )
    print(f"\nGPU: {gpu}; {minutes:g} min per shard; checks: {checks}")
    header = f"{'kernel':<32} {'checked':>8} {'passed':>7} {'known':>6} {'skipped':>8}"
    header += f" {'cases/min':>10}" + (f" {'run-to-run differs':>19}" if backward else "")
    print(header + "  failed checks (known: declared known findings)")
    total, wall = 0, max((r["elapsed"] for r in results), default=1.0)
    for kernel in kernels:
        if any(r.get("absent") for r in results if r["kernel"] == kernel):
            print(f"{kernel:<32} declares no backward")
            continue
        verdicts = [v for r in results if r["kernel"] == kernel for v in r["verdicts"]]
        checked = [v for v in verdicts if v["skipped"] is None]
        failed = collections.Counter(
            ("known " if v["known"] else "") + f[0] for v in checked for f in v["findings"]
        )
        passed = sum(1 for v in checked if not v["findings"])
        known = sum(1 for v in checked if v["known"])
        elapsed = max((r["elapsed"] for r in results if r["kernel"] == kernel), default=1.0)
        total += len(checked)
        fails = ", ".join(f"{k}={n}" for k, n in sorted(failed.items())) or "-"
        skipped, rate = len(verdicts) - len(checked), 60 * len(checked) / elapsed
        row = f"{kernel:<32} {len(checked):>8} {passed:>7} {known:>6} {skipped:>8} {rate:>10.1f}"
        differs = sum(1 for v in checked if v["differing"])
        print(row + (f" {differs:>19}" if backward else "") + f"  {fails}")
    for kernel in kernels:
        seen = set()
        for r in results:
            for v in r["verdicts"] if r["kernel"] == kernel else ():
                if v["known"]:
                    continue
                for check, message, _ in v["findings"]:
                    if check not in seen:
                        seen.add(check)
                        print(f"  {kernel} {check}: {v['case']}\n    {message[:400]}")
    rate = 60 * total / wall
    print(f"{'all':<32} {total:>8} {'':>7} {'':>6} {'':>8} {rate:>10.1f}  (wall {wall:.0f} s)")


if __name__ == "__main__":
    main()
