"""Which strategy catches which broken streaming tier, after how many examples and seconds.

Run from the repository root: ``python -m benchmarks.bench_mutants``.
Uses the ``ci`` Hypothesis profile as registered by the pytest plugin (derandomized, so the numbers
repeat), without the example database. Prints two Markdown tables for docs/mutants.md:

1. every mutant hunted with ``attention_cases()`` (all distributions), shrinking included:
   examples until the first counterexample, seconds to it, total seconds with shrinking, the
   distribution / mask of the first and of the shrunk counterexample;
2. mutant x mask kind, and 3. mutant x score distribution without masks: examples until
   caught with only that strategy (no shrinking; ``-`` = survived max_examples);
4. the backward mutants (``testing/mutants_backward.py``) x every backward property
   (``properties/backward_properties.py``): generated examples until caught, no shrinking,
   the unmutated tier as the control row, and the mutation score;
5. (``--part fp8``) the CPU FP8 kernels (``testing/broken/cpu_fp8.py``) under the default
   kernel suite (``pytest -m cpu properties/test_kernels.py --kernel ...``), ci profile, one
   pytest process per run seed of ``--seeds``: the seeds it failed on (``fp8_fixed`` the
   control row), the checks named, seconds.

``--part forward|backward|both|fp8`` picks the tables (default: both, without fp8).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from hypothesis import Phase, settings
from threadpoolctl import threadpool_limits

import attention_crossval.pytest_plugin  # noqa: F401  (registers the Hypothesis profiles)
from attention_crossval.properties.backward_properties import PROPERTIES
from attention_crossval.properties.strategies import DISTRIBUTIONS, REFERENCE_SPEC, attention_cases
from attention_crossval.reference import streaming as reference_streaming
from attention_crossval.reference import streaming_backward as reference_backward
from attention_crossval.testing.mutants import MUTANTS, HuntResult, hunt, load_mutant
from attention_crossval.testing.mutants_backward import (
    BACKWARD_MUTANTS,
    hunt_backward,
    load_backward_mutant,
)
from benchmarks.bench_backward_mutants import run_suite

NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


def _field(label: str | None, name: str) -> str:
    for part in (label or "").split():
        if part.startswith(f"{name}="):
            return part.removeprefix(f"{name}=")
    return "-"


def _hunt(attention, profile: settings, *, shrink: bool, **strategy_options) -> HuntResult:
    phases = tuple(Phase) if shrink else NO_SHRINK
    return hunt(
        attention,
        attention_cases(**strategy_options),
        block_m=REFERENCE_SPEC.tile_m,
        block_n=REFERENCE_SPEC.tile_n,
        hypothesis_settings=settings(profile, database=None, phases=phases, derandomize=True),
    )


def overall_table(profile: settings) -> list[str]:
    rows = [
        "| mutant | caught | examples | s to catch | s with shrink | first: distribution / mask "
        "| shrunk: distribution / shape / mask |",
        "|---|---|---|---|---|---|---|",
    ]
    candidates = [("(control: unmutated)", reference_streaming.streaming_attention)]
    candidates += [(name, load_mutant(name).streaming_attention) for name in MUTANTS]
    for name, attention in candidates:
        r = _hunt(attention, profile, shrink=True)
        first = f"{_field(r.first_label, 'dist')} / {_field(r.first_label, 'mask')}"
        shrunk = " / ".join(_field(r.shrunk_label, f) for f in ("dist", "shape", "mask"))
        to_catch = f"{r.seconds_to_catch:.2f}" if r.seconds_to_catch is not None else "-"
        rows.append(
            f"| {name} | {'yes' if r.caught else 'no'} | {r.examples} | {to_catch} | "
            f"{r.seconds_total:.2f} | {first if r.caught else '-'} | "
            f"{shrunk if r.caught else '-'} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _matrix(profile: settings, columns: dict[str, dict]) -> list[str]:
    """Examples until caught per mutant (rows) and strategy restriction (columns)."""
    rows = ["| mutant | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name in MUTANTS:
        attention = load_mutant(name).streaming_attention
        cells = []
        for options in columns.values():
            r = _hunt(attention, profile, shrink=False, **options)
            cells.append(f"{r.examples} ({r.seconds_to_catch:.1f}s)" if r.caught else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def distribution_table(profile: settings) -> list[str]:
    """Without masks (varlen for nonfinite_padding): only the distribution exposes the bug."""
    return _matrix(
        profile,
        {
            name: {  # NaN/Inf may only sit in padding, so that family keeps varlen
                "distributions": [name],
                "mask_kinds": ("varlen",) if dist.needs_key_padding else (),
            }
            for name, dist in DISTRIBUTIONS.items()
        },
    )


def mask_table(profile: settings) -> list[str]:
    """One mask kind at a time (all distributions)."""
    kinds = {"none": (), **{kind: (kind,) for kind in ("causal", "window", "varlen", "explicit")}}
    return _matrix(profile, {name: {"mask_kinds": k} for name, k in kinds.items()})


def backward_table(profile: settings) -> list[str]:
    """Backward mutants (rows) x backward properties (columns): examples until caught (no
    shrinking; ``-`` = survived max_examples); ``*`` marks the property named to catch it."""
    names = list(PROPERTIES)
    rows = [
        "| mutant | " + " | ".join(names) + " | caught by |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    tiers = [("(control: unmutated)", reference_backward, None)]
    tiers += [(n, load_backward_mutant(n), m.caught_by) for n, m in BACKWARD_MUTANTS.items()]
    hunt_settings = settings(profile, database=None, phases=NO_SHRINK)
    caught_any = 0
    for name, tier, named in tiers:
        cells, caught = [], 0
        for prop in names:
            r = hunt_backward(tier, PROPERTIES[prop], hunt_settings)
            mark = "*" if prop == named else ""
            cells.append(f"{r.examples}{mark} ({r.seconds_to_catch:.1f}s)" if r.caught else "-")
            caught += r.caught
        caught_any += bool(caught) and named is not None
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {caught}/{len(names)} |")
        print(rows[-1], file=sys.stderr, flush=True)
    rows.append(f"\nMutation score: {caught_any}/{len(BACKWARD_MUTANTS)} backward mutants caught.")
    return rows


FP8_KERNELS = ("fp8_fixed", "fa4_saturation", "forgets_k_descale", "v_descale_in_p")


def fp8_table(seeds: int) -> list[str]:
    """The CPU FP8 kernels under the default kernel suite (every test of
    ``properties/test_kernels.py``), one ci-profile pytest process per run seed
    (``bench_backward_mutants.run_suite``): the seeds it failed on, the checks named."""
    rows = [
        "| kernel | failed on seeds | checks named | seconds (all seeds) |",
        "|---|---|---|---|",
    ]
    for name in FP8_KERNELS:
        failed, checks, total = [], set(), 0.0
        for seed in range(seeds):
            kernel = f"attention_crossval.testing.broken.cpu_fp8:{name}"
            fails, check, seconds = run_suite(kernel, seed, "properties/test_kernels.py")
            print(f"{name} seed {seed}: {check if fails else 'passed'}", file=sys.stderr)
            total += seconds
            if fails:
                failed.append(seed)
                checks.add(check)
        shown = " ".join(map(str, failed)) or "-"
        named = ", ".join(sorted(checks)) or "-"
        rows.append(f"| {name} | {len(failed)}/{seeds}: {shown} | {named} | {total:.0f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mutants")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--skip-matrix", action="store_true", help="only the overall table")
    parser.add_argument("--part", choices=("forward", "backward", "both", "fp8"), default="both")
    parser.add_argument("--seeds", type=int, default=10, help="--part fp8: seeds per kernel")
    args = parser.parse_args(argv)
    profile = settings.get_profile(args.profile)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, profile {args.profile} "
        f"(max_examples={profile.max_examples}, derandomized), "
        f"tiles {REFERENCE_SPEC.tile_m}x{REFERENCE_SPEC.tile_n}\n"
    )
    if args.part == "fp8":
        print(
            f"FP8 kernels under the default kernel suite, ci profile, seeds 0..{args.seeds - 1}:\n"
        )
        print("\n".join(fp8_table(args.seeds)))
        return 0
    if args.part in ("backward", "both"):
        print("Backward: examples until caught per property (no shrinking):\n")
        print("\n".join(backward_table(profile)) + "\n")
    if args.part == "backward":
        return 0
    print("\n".join(overall_table(profile)))
    if not args.skip_matrix:
        print("\nExamples until caught, one mask kind at a time (no shrinking):\n")
        print("\n".join(mask_table(profile)))
        print("\nExamples until caught, one score distribution at a time, no masks:\n")
        print("\n".join(distribution_table(profile)))
    return 0


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # docs/numerics.md#small-gemms
        sys.exit(main())
