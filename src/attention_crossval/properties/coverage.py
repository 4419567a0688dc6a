"""Which shape classes x masks x score distributions x dtypes a test run actually generated,
which forward-surface features it drew (softcap, sink, hidden keys, paged, splits, packed, varlen
batches, long decode: the label's ``features=`` part), and the sweeps that make every
distribution, every declared mask kind and every declared feature appear in each run.

:func:`properties.strategies.attention_cases` calls :func:`record` for every case it builds
(shrink attempts included, so counts are draws, not distinct tests). As a pytest plugin
(registered by the package's pytest plugin) this module prints the summary at
the end of the run. Under pytest-xdist each worker counts its own draws and the controller sees
none, so run without ``-n`` when you want the table.
"""

from __future__ import annotations

from collections import Counter

import pytest

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.features import FEATURES, spec_features
from attention_crossval.properties._strategies.scores import DISTRIBUTIONS
from attention_crossval.reference.case import AttentionCase

AXES = ("shape", "mask", "dist", "dtype")
_hits: Counter[tuple[str, ...]] = Counter()
_features: Counter[str] = Counter()


def coverage_key(case: AttentionCase) -> tuple[str, ...] | None:
    """``(shape, mask, dist, dtype)`` read from a label written by ``attention_cases``."""
    fields = dict(part.split("=", 1) for part in case.label.split() if "=" in part)
    if not all(axis in fields for axis in AXES):
        return None
    return tuple(fields[axis] for axis in AXES)


def sweep(spec: KernelSpec) -> list[tuple[str, str]]:
    """``(distribution, mask kind)`` pairs that together use every score distribution ``spec``
    allows and every mask kind it declares ("none" when it declares none): one pair per
    distribution, the kinds taken in turn, ``nonfinite_padding`` with ``varlen`` (it needs
    padding). A random sample of 60 cases drew only 7-11 of the 14 distributions; a test
    parametrized over these pairs cannot miss one."""
    kinds = sorted(spec.mask_kinds) or ["none"]
    names = [n for n, d in DISTRIBUTIONS.items() if "varlen" in kinds or not d.needs_key_padding]
    return [
        (name, "varlen" if DISTRIBUTIONS[name].needs_key_padding else kinds[i % len(kinds)])
        for i, name in enumerate(names)
    ]


def feature_sweep(spec: KernelSpec) -> list[str]:
    """The features ``spec`` declares: a test parametrized over them draws each one in every
    run (a free sample of 30 cases may miss a feature drawn one time in eight)."""
    return list(spec_features(spec))


def features_of(case: AttentionCase) -> list[str]:
    """The ``features=a+b`` of an ``attention_cases`` label (empty when it has none)."""
    for part in case.label.split():
        key, _, value = part.partition("=")
        if key == "features":
            return value.split("+")
    return []


def record(case: AttentionCase) -> None:
    """Count one generated case (cases without an ``attention_cases`` label are ignored)."""
    key = coverage_key(case)
    if key is not None:
        _hits[key] += 1
        _features.update(features_of(case))


def hits() -> Counter[tuple[str, ...]]:
    """A copy of the counts so far, keyed by ``(shape, mask, dist, dtype)``."""
    return Counter(_hits)


def feature_hits() -> Counter[str]:
    """A copy of the per-feature draw counts so far."""
    return Counter(_features)


def summary(
    counts: Counter[tuple[str, ...]] | None = None, features: Counter[str] | None = None
) -> str:
    """Per-axis tallies (value: draws), the number of distinct combinations hit, and the
    draws per forward-surface feature (features never drawn show 0)."""
    counts = _hits if counts is None else counts
    features = _features if features is None else features
    if not counts:
        return "no attention_cases drawn"
    lines = [
        f"{len(counts)} distinct shape x mask x distribution x dtype combinations, "
        f"{sum(counts.values())} draws"
    ]
    for index, axis in enumerate(AXES):
        per_value: Counter[str] = Counter()
        for key, n in counts.items():
            per_value[key[index]] += n
        values = ", ".join(f"{value} {n}" for value, n in sorted(per_value.items()))
        lines.append(f"  {axis} ({len(per_value)}): {values}")
    drawn = ", ".join(f"{name} {features[name]}" for name in FEATURES)
    lines.append(f"  features ({sum(1 for n in FEATURES if features[n])}): {drawn}")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _hits:
        terminalreporter.write_sep("-", "attention case coverage")
        terminalreporter.write_line(summary())
