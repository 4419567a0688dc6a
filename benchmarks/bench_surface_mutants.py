"""How fast the surface mutants are caught, over several Hypothesis seeds.

Run from the repository root: ``python -m benchmarks.bench_surface_mutants
--seeds 10`` (``--first-seed`` picks another range of seeds). Two tables (``--part
reference|kernel|both``, default both):

* reference: each mutant of ``testing/mutants_surface.py`` that the float64 agreement
  property hunts (softcap, sinks) is hunted with ``surface_reference_cases`` restricted to its
  surfaces, 25 examples (the dev profile's budget); the unmutated tier on every surface;
* kernel: each split-KV and paged mutant inside the CPU ``streaming-fa`` kernel
  (``surface_mutant_kernel``) against the default kernel suite's free test as CI runs it: the
  ``ci`` profile, its cap for a CPU kernel (``properties/test_kernels.py``), cases from
  ``attention_cases(spec=...)`` with every declared feature, seeded as a run with seed ``s``
  seeds ``streaming-fa`` (``derived_seed``); the unmutated kernel as the control row.

No shrinking, no example database, one run per seed (the reference table seeds through
``random.seed``, from which Hypothesis draws a run's seed when not derandomized). Cells:
examples to the first catch per seed ("-" = survived), and the seconds over all seeds.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from hypothesis import Phase, settings
from threadpoolctl import threadpool_limits

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.properties.kernel_suite import max_len_for, settings_for
from attention_crossval.properties.strategies import attention_cases
from attention_crossval.pytest_plugin import derived_seed
from attention_crossval.reference import streaming as reference_streaming
from attention_crossval.testing.mutants import HuntResult, hunt
from attention_crossval.testing.mutants_surface import (
    KERNEL_MUTANTS,
    SURFACE_SPEC,
    InProcessKernel,
    hunt_kernel,
    load_surface_mutant,
    surface_mutant_kernel,
    surface_reference_cases,
)

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
SINKS = ("sink", "sink_dominant", "sink_below")
HUNTED = {
    "(unmutated)": None,
    "softcap_before_scale": ("softcap", "softcap_saturated"),
    "sink_left_out_of_lse": SINKS,
    "sink_weight_dropped": SINKS,
    "sink_outside_running_max": ("sink_dominant",),  # only an overflowing sink shows it
}


def _row(name: str, results: list[HuntResult], seconds: float) -> str:
    counts = [str(r.examples) if r.caught else "-" for r in results]
    caught = sum(r.caught for r in results)
    return f"| {name} | {' '.join(counts)} | {caught}/{len(results)} | {seconds:.1f} |"


def reference_table(seeds: range) -> None:
    print("\n| mutant | examples to catch, per seed | caught | seconds |\n|---|---|---|---|")
    for name, surfaces in HUNTED.items():
        attention = (
            reference_streaming.streaming_attention
            if surfaces is None
            else load_surface_mutant(name).streaming_attention
        )
        results, start = [], time.perf_counter()
        for s in seeds:
            chosen = settings(max_examples=25, database=None, phases=NO_SHRINK, deadline=None)
            random.seed(s)  # Hypothesis draws its run's seed from the global generator
            results.append(
                hunt(
                    attention,
                    surface_reference_cases(surfaces),
                    block_m=SURFACE_SPEC.tile_m,
                    block_n=SURFACE_SPEC.tile_n,
                    hypothesis_settings=chosen,
                )
            )
        print(_row(name, results, time.perf_counter() - start))


def kernel_table(seeds: range) -> None:
    settings.load_profile("ci")
    control = StreamingAdapter()
    spec = control.spec
    chosen = settings(settings_for(spec), phases=NO_SHRINK)
    strategy = attention_cases(spec=spec, max_len=max_len_for(spec))
    print(
        f"\nkernel suite: {spec.name}, ci profile, {chosen.max_examples} examples, "
        f"max_len {max_len_for(spec)}"
    )
    print("\n| mutant | examples to catch, per seed | caught | seconds |\n|---|---|---|---|")
    kernels = {"(unmutated streaming-fa)": InProcessKernel(control)}
    kernels.update({name: InProcessKernel(surface_mutant_kernel(name)) for name in KERNEL_MUTANTS})
    for name, adapter in kernels.items():
        results, start = [], time.perf_counter()
        for s in seeds:
            seed = derived_seed(s, spec.name)
            results.append(hunt_kernel(adapter, strategy, chosen, seed=seed))
        print(_row(name, results, time.perf_counter() - start), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="the first of the seeds")
    parser.add_argument("--part", choices=("reference", "kernel", "both"), default="both")
    args = parser.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}")
    if args.part in ("reference", "both"):
        reference_table(seeds)
    if args.part in ("kernel", "both"):
        kernel_table(seeds)


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        main()
