"""How fast the softcap and sink mutants are caught, over several Hypothesis seeds.

Run from the repository root: ``OPENBLAS_NUM_THREADS=1 python -m benchmarks.bench_surface_mutants
--seeds 12``. Each mutant of ``properties/mutants_surface.py`` that the float64 agreement property
hunts (softcap, sinks) is hunted with ``surface_reference_cases`` restricted to its surfaces,
25 examples (the dev profile's budget), no shrinking, no example database, one run per seed
(``random.seed``, from which Hypothesis draws a run's seed when not derandomized); the
unmutated tier is hunted the same way on every surface. Prints a Markdown table: examples to
the first catch per seed ("-" = survived), and the seconds over all seeds.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import Phase, settings  # noqa: E402

from attention_crossval.properties.mutants import hunt  # noqa: E402
from attention_crossval.properties.mutants_surface import (  # noqa: E402
    SURFACE_SPEC,
    load_surface_mutant,
    surface_reference_cases,
)
from attention_crossval.reference import streaming as reference_streaming  # noqa: E402

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
SINKS = ("sink", "sink_dominant", "sink_below")
HUNTED = {
    "(unmutated)": None,
    "softcap_before_scale": ("softcap", "softcap_saturated"),
    "sink_left_out_of_lse": SINKS,
    "sink_weight_dropped": SINKS,
    "sink_outside_running_max": ("sink_dominant",),  # only an overflowing sink shows it
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}")
    print("\n| mutant | examples to catch, per seed | caught | seconds |\n|---|---|---|---|")
    for name, surfaces in HUNTED.items():
        attention = (
            reference_streaming.streaming_attention
            if surfaces is None
            else load_surface_mutant(name).streaming_attention
        )
        counts, start = [], time.perf_counter()
        for s in range(args.seeds):
            chosen = settings(max_examples=25, database=None, phases=NO_SHRINK, deadline=None)
            random.seed(s)  # Hypothesis draws its run's seed from the global generator
            result = hunt(
                attention,
                surface_reference_cases(surfaces),
                block_m=SURFACE_SPEC.tile_m,
                block_n=SURFACE_SPEC.tile_n,
                hypothesis_settings=chosen,
            )
            counts.append(str(result.examples) if result.caught else "-")
        caught = sum(c != "-" for c in counts)
        seconds = time.perf_counter() - start
        print(f"| {name} | {' '.join(counts)} | {caught}/{args.seeds} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
