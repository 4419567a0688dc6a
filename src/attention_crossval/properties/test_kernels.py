"""Kernels under test against the references, under the defensive harness
(kernel/harness/forward.py).

Kernels come from ``--kernel`` (built-in name or ``package.module:attr``, repeatable); without
it, every built-in GPU adapter whose package is installed, and without a GPU also the CPU
``streaming-fa``. Each kernel's tests carry the ``kernel`` marker and ``cpu`` or ``gpu`` by its
``spec.device``, so a CPU kernel runs under ``-m cpu`` with no CUDA. Each kernel runs in its own
worker process, so a fault or hang is a finding for that case and the session goes on.

Three tests per kernel: the free Hypothesis test (which draws the forward-surface features the
kernel declares: softcap, sinks, keys hidden behind masks, paged KV, split-KV, packed varlen,
varlen batches of 3+, long decode), a sweep over (score distribution, mask kind) pairs
(``properties.coverage.sweep``) that makes every distribution and every declared mask kind
appear in every run, and a sweep over the declared features
(``properties.coverage.feature_sweep``) that does the same for each feature, with a case per
value class of the feature. The sweeps keep the base features (varlen batches of 3+, long
decode) and draw lengths to 8 K blocks. A failure prints one compact summary (check, worst
element, shape, mask, distribution, the saved ``.npz`` and its replay command), never the
arrays; cases are seeded per kernel and test from the run's seed (``stream_seed``: the free
test by the kernel's name, each sweep pair, feature and other file's free run by its own
stream, so no two tests draw the same cases). In the sweeps a case whose every failure is a
known finding counts as run; the free test rejects it and draws another (``run_property``).
"""

from __future__ import annotations

import pytest

from attention_crossval.properties.coverage import coverage_key, feature_sweep, sweep
from attention_crossval.properties.kernel_suite import (  # noqa: F401 - the autouse fixture
    FREE,
    SWEEP_EXAMPLES,
    feature_examples,
    feature_strategy,
    free_parts,
    free_property,
    run_property,
    settings_for,
    sweep_strategy,
)
from attention_crossval.properties.kernels_under_test import (
    chosen_kernels,
    kernel_param,
    kernel_spec,
)
from attention_crossval.properties.strategies import case_features


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel" not in metafunc.fixturenames:
        return
    kernels = chosen_kernels(metafunc.config)
    if "distribution" in metafunc.fixturenames:
        pairs = [(k, *pair) for k in kernels for pair in sweep(kernel_spec(k))]
        params = [kernel_param(k, d, m, id=f"{k}-{d}-{m}") for k, d, m in pairs]
        metafunc.parametrize(("kernel", "distribution", "mask_kind"), params)
    elif "feature" in metafunc.fixturenames:
        pairs = [(k, f) for k in kernels for f in feature_sweep(kernel_spec(k))]
        params = [kernel_param(k, f, id=f"{k}-{f}") for k, f in pairs]
        metafunc.parametrize(("kernel", "feature"), params)
    else:
        params = []
        for k in kernels:
            parts = free_parts(kernel_spec(k))
            params += [
                kernel_param(k, part, parts, id=k if parts == 1 else f"{k}-part{part + 1}of{parts}")
                for part in range(parts)
            ]
        metafunc.parametrize(("kernel", "part", "parts"), params)


def test_kernel_passes_every_check(
    kernel: str, part: int, parts: int, request: pytest.FixtureRequest
) -> None:
    """Every generated case inside the kernel's declaration passes every applicable check (a
    GPU kernel's cases in :func:`free_parts` tests, each a share of them)."""
    free_property(kernel, request.config, part=part, parts=parts)


def test_kernel_sweep_passes_every_check(
    kernel: str, distribution: str, mask_kind: str, request: pytest.FixtureRequest
) -> None:
    """One (distribution, mask kind) pair of the kernel's sweep: together the pairs put every
    score distribution and every declared mask kind in front of the kernel in every run."""
    spec = kernel_spec(kernel)
    required = () if mask_kind == "none" else (mask_kind,)
    ran = run_property(
        kernel,
        request.config,
        sweep_strategy(spec, distribution, mask_kind),
        settings_for(spec, max_examples=SWEEP_EXAMPLES),
        stream=f"sweep:{distribution}:{mask_kind}",
        count_known=True,
    )
    assert ran, f"{kernel} declined every {distribution} x {mask_kind} case drawn"
    for case in ran:  # the pair was really drawn (the sweep's coverage claim)
        drawn = coverage_key(case)[2]
        assert drawn == distribution and set(required) <= case.mask.kinds, case.describe()


def test_kernel_feature_passes_every_check(
    kernel: str, feature: str, request: pytest.FixtureRequest
) -> None:
    """One declared forward-surface feature, on every case (Hypothesis' simplest first, e.g. a
    single query over 4096 keys with GQA for ``long_decode``): together they put every feature
    the kernel declares in front of it in every run, the ``hidden-nan`` check included where
    the adapter opts in (keys hidden by a window where the kernel has no explicit masks)."""
    spec = kernel_spec(kernel)
    ran = run_property(
        kernel,
        request.config,
        feature_strategy(spec, feature),
        settings_for(spec, max_examples=feature_examples(feature)),
        stream=f"feature:{feature}",
        count_known=True,
    )
    assert ran, f"{kernel} declined every {feature} case drawn"
    for case in ran:  # the feature was really drawn (the sweep's coverage claim)
        assert feature in case_features(case), case.describe()
