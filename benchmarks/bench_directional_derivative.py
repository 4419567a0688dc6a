"""How close the directional-derivative property runs to its allowance, over many drawn cases.

Run from the repository root: ``PYTHONPATH=src python -m benchmarks.bench_directional_derivative
[--examples 2000 --seed 1]``. Draws the property's own strategy (``drawn_examples``: generation
only, seeded) and evaluates :func:`directional_residual` on the production streaming backward.
Prints one row per kind of case (with and without an LSE gradient): the largest ``|diff| /
scale`` (what ``DIRECTIONAL_RTOL`` must cover), the largest ``radius / scale`` (the exact
forward's certified error through the quotient), how many cases the radius dominates, and the
largest ``|diff| / allowed`` (above 1 is a failure).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attention_crossval.properties.backward_properties import (
    DIRECTIONAL_RTOL,
    PROPERTIES,
    directional_residual,
)
from attention_crossval.properties.strategies import drawn_examples
from attention_crossval.reference import streaming_backward
from benchmarks.bench_exact import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_directional_derivative")
    parser.add_argument("--examples", type=int, default=2000, help="cases drawn (default 2000)")
    parser.add_argument("--seed", type=int, default=1, help="Hypothesis seed (default 1)")
    args = parser.parse_args(argv)
    strategy = PROPERTIES["directional_derivative"].strategy
    with threadpool_limits(limits=1, user_api="blas"):
        start = time.perf_counter()
        drawn = drawn_examples(strategy, args.examples, seed=args.seed)
        residuals = [directional_residual(streaming_backward, *a) for a in drawn]
        seconds = time.perf_counter() - start
        print(f"machine: {machine()}\n{len(drawn)} cases, seed {args.seed}, {seconds:.0f} s\n")
    print(
        "| cases | count | max abs(diff)/scale | max radius/scale | radius > RTOL scale "
        "| max abs(diff)/allowed | failed |\n|---|---|---|---|---|---|---|"
    )
    with_dlse = np.array([a[2] for a in drawn])
    diff = np.array([abs(r.estimate - r.expected) for r in residuals])
    scale = np.array([r.scale for r in residuals]) + 1e-300
    radius = np.array([r.radius for r in residuals])
    allowed = np.array([r.allowed for r in residuals])
    for name, chosen in (("without dlse", ~with_dlse), ("with dlse", with_dlse)):
        if not chosen.any():
            continue
        print(
            f"| {name} | {chosen.sum()} | {(diff / scale)[chosen].max():.3g} "
            f"| {(radius / scale)[chosen].max():.3g} "
            f"| {(radius > DIRECTIONAL_RTOL * scale)[chosen].sum()} "
            f"| {(diff / allowed)[chosen].max():.3g} | {(diff > allowed)[chosen].sum()} |"
        )
    return int((diff > allowed).any())


if __name__ == "__main__":
    raise SystemExit(main())
