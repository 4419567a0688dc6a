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
known finding counts as run; the free test rejects it and draws another (``_run_property``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Verbosity, assume, event, given, seed, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.known import covering, run_with_known, xfail_if_known
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.properties.coverage import coverage_key, feature_sweep, sweep
from attention_crossval.properties.fail_fast import run_failing_fast, stop_on_fault
from attention_crossval.properties.kernels_under_test import (
    chosen_kernels,
    close_workers,
    kernel_adapter,
    kernel_param,
    kernel_spec,
    worker,
)
from attention_crossval.properties.replay import reproducer_on_failure
from attention_crossval.properties.strategies import attention_cases, case_features
from attention_crossval.pytest_plugin import kernel_seed
from attention_crossval.reference.case import AttentionCase, Mask

BROKEN = ("no_rescale", "oob_write", "skip_last_tile", "read_padding")
# A CPU kernel's free test stays at most two K blocks plus one key long (GPU kernels: four), and
# at most 30 examples (the profile's count if lower): streaming-fa's free test would take
# minutes with four blocks and 60 examples.
CPU_MAX_EXAMPLES = 30
# Per sweep pair: Hypothesis' simplest case first, then one drawn from the pair's own seed, with
# lengths to SWEEP_BLOCKS K blocks and one key.
SWEEP_EXAMPLES = 2
SWEEP_BLOCKS = 8
# The value classes each feature has, which its sweep draws one case more than (the simplest
# first): the surfaces of softcap (plain, saturated, with a sink) and sink (competing,
# dominant, below, with a softcap); page sizes that divide the K block or not; split counts at
# most and above the K blocks; varlen batches as a decode or not; long decodes of 1, 2 and 16
# queries. Others: one class.
FEATURE_CLASSES = {
    "softcap": 3,
    "sink": 4,
    "paged": 2,
    "splits": 2,
    "varlen_batch": 2,
    "long_decode": 3,
}
# The free test's seed stream: each other test of a kernel (a sweep pair, a feature, another
# file's run of the free property) names its own stream, so no two draw the same cases.
FREE = "free"


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
        metafunc.parametrize("kernel", [kernel_param(k, id=k) for k in kernels])


@pytest.fixture(scope="module", autouse=True)
def _close_workers():
    yield
    close_workers()


def _settings_for(spec: KernelSpec, max_examples: int | None = None) -> settings:
    """The profile's settings, quiet (Hypothesis would print the drawn case with its arrays: the
    failure message carries a compact summary instead), without the example database (a
    kernel's cases come from its seed), at most :data:`CPU_MAX_EXAMPLES` for a CPU kernel."""
    examples = settings.default.max_examples if max_examples is None else max_examples
    if spec.device == "cpu":
        examples = min(examples, CPU_MAX_EXAMPLES)
    return settings(
        settings.default, verbosity=Verbosity.quiet, database=None, max_examples=examples
    )


def _max_len(spec: KernelSpec, blocks: int | None = None) -> int:
    """``blocks`` K blocks and one key; by default (the free test) four for a GPU kernel, two
    for a CPU kernel."""
    blocks = blocks or (4 if spec.device == "cuda" else 2)
    return min(blocks * spec.tile_n + 1, spec.max_seqlen)


def stream_name(kernel: str, stream: str) -> str:
    """What one of ``kernel``'s tests derives its seed from: the free test (:data:`FREE`)
    the kernel's name (its cases stay what they were), every other stream its own name too."""
    return kernel if stream == FREE else f"{kernel}:{stream}"


def stream_seed(config: pytest.Config, kernel: str, stream: str) -> int | None:
    """The Hypothesis seed of one of ``kernel``'s tests (:func:`kernel_seed` of
    :func:`stream_name`), or None (random)."""
    return kernel_seed(config, stream_name(kernel, stream))


def _run_property(
    kernel: str,
    config: pytest.Config,
    strategy: st.SearchStrategy[AttentionCase],
    chosen: settings,
    *,
    stream: str,
    count_known: bool = False,
) -> list[AttentionCase]:
    """Check every case ``strategy`` draws under ``chosen``, seeded for ``kernel`` and
    ``stream`` from the run's seed (:func:`stream_seed`); returns the cases that ran (declined
    ones excluded). A finding fails with the compact summary and the saved case's replay
    command (at most a few cases saved per test, the shrunk one always). A case whose every
    finding is known is rejected, so Hypothesis draws another (the free test searches past
    known findings), or, with ``count_known`` (the sweeps), counted as run: it passed every
    other check, and rejecting it made a two-example sweep draw up to 458 replacements where
    known findings cover most of a feature's cases (docs/forward-surface.md, "Default
    strategy and coverage")."""
    __tracebackhide__ = True
    adapter = kernel_adapter(kernel)
    ran: list[AttentionCase] = []

    @chosen
    @given(case=strategy)
    def check(case: AttentionCase) -> None:
        __tracebackhide__ = True  # pytest would print the case's arrays as this frame's argument
        verdict = run_with_known(adapter, case)
        stop_on_fault(kernel, verdict, case)  # a crash or hang: reported as drawn, not shrunk
        assume(verdict.skipped is None)  # declined by the kernel at run time
        known = covering(adapter.spec, case, verdict.findings)
        if count_known and known:
            event(f"known, counted: {', '.join(k.check for k in known)}")
            ran.append(case)
            return
        xfail_if_known(verdict, adapter.spec, case)  # inside Hypothesis: the example is rejected
        ran.append(case)
        with reproducer_on_failure(case, kernel=kernel):
            verdict.raise_for()

    derived = stream_seed(config, kernel, stream)
    run_failing_fast(kernel, config, check if derived is None else seed(derived)(check))
    return ran


def free_property(kernel: str, config: pytest.Config, stream: str = FREE) -> None:
    """The free property: every case drawn inside the kernel's declaration passes every
    applicable check; ``stream`` names the seed stream (another file's run of it names its
    own, so it draws other cases)."""
    spec = kernel_spec(kernel)
    strategy = attention_cases(spec=spec, max_len=_max_len(spec))
    ran = _run_property(kernel, config, strategy, _settings_for(spec), stream=stream)
    assert ran, f"{kernel} declined every case drawn: nothing was checked"


def sweep_strategy(spec: KernelSpec, distribution: str, mask_kind: str):
    """The cases of one (distribution, mask kind) sweep pair: the base features (varlen
    batches of 3+, long decode) stay in, lengths reach :data:`SWEEP_BLOCKS` K blocks."""
    return attention_cases(
        spec=spec,
        max_len=_max_len(spec, SWEEP_BLOCKS),
        distributions=[distribution],
        required_mask_kinds=() if mask_kind == "none" else (mask_kind,),
    )


def feature_strategy(spec: KernelSpec, feature: str):
    """The cases of one feature's sweep (``hidden`` under a window where the kernel has no
    explicit masks), lengths to :data:`SWEEP_BLOCKS` K blocks."""
    window = feature == "hidden" and "explicit" not in spec.mask_kinds
    return attention_cases(
        spec=spec,
        max_len=_max_len(spec, SWEEP_BLOCKS),
        required_features=[feature],
        required_mask_kinds=("window",) if window else (),
    )


def feature_examples(feature: str) -> int:
    """Cases per feature sweep: the simplest, then one per value class (:data:`FEATURE_CLASSES`)."""
    return 1 + FEATURE_CLASSES.get(feature, 1)


def test_kernel_passes_every_check(kernel: str, request: pytest.FixtureRequest) -> None:
    """Every generated case inside the kernel's declaration passes every applicable check."""
    free_property(kernel, request.config)


def test_kernel_sweep_passes_every_check(
    kernel: str, distribution: str, mask_kind: str, request: pytest.FixtureRequest
) -> None:
    """One (distribution, mask kind) pair of the kernel's sweep: together the pairs put every
    score distribution and every declared mask kind in front of the kernel in every run."""
    spec = kernel_spec(kernel)
    required = () if mask_kind == "none" else (mask_kind,)
    ran = _run_property(
        kernel,
        request.config,
        sweep_strategy(spec, distribution, mask_kind),
        _settings_for(spec, max_examples=SWEEP_EXAMPLES),
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
    ran = _run_property(
        kernel,
        request.config,
        feature_strategy(spec, feature),
        _settings_for(spec, max_examples=feature_examples(feature)),
        stream=f"feature:{feature}",
        count_known=True,
    )
    assert ran, f"{kernel} declined every {feature} case drawn"
    for case in ran:  # the feature was really drawn (the sweep's coverage claim)
        assert feature in case_features(case), case.describe()


def _ramp_case(
    Sq: int, Sk: int, *, k_lengths: tuple[int, ...] | None = None, B: int = 1
) -> AttentionCase:
    """Scores rising along the keys: every K block raises the running max (needs the rescale)."""
    rng = np.random.default_rng(7)
    D, H = 64, 2
    q = np.full((B, Sq, H, D), 0.25) + 0.01 * rng.standard_normal((B, Sq, H, D))
    ramp = np.linspace(0.0, 3.0, Sk)[None, :, None, None]
    k = ramp + 0.05 * rng.standard_normal((B, Sk, H, D))
    v = rng.standard_normal((B, Sk, H, D))
    mask = Mask(k_lengths=k_lengths) if k_lengths is not None else Mask()
    arrays = (np.asarray(a, dtype=np.float16) for a in (q, k, v))
    return AttentionCase(*arrays, mask=mask, label="ramp")


# Each bug with a case that exposes it: a ramp over several K blocks (rescale), Sq not a
# multiple of the 64-row tile (out-of-bounds stores, the last tile), keys past k_lengths.
_TRIGGERS = {
    "no_rescale": lambda: _ramp_case(65, 256),
    "oob_write": lambda: _ramp_case(100, 130),
    "skip_last_tile": lambda: _ramp_case(130, 70),
    "read_padding": lambda: _ramp_case(64, 160, k_lengths=(100, 37), B=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BROKEN)
def test_broken_triton_kernel_is_caught_by_its_check(variant: str) -> None:
    """The deliberately broken kernel fails exactly its named check and no other; the correct one
    passes."""
    case = _TRIGGERS[variant]()
    broken = resolve(f"attention_crossval.testing.broken.triton_fa:{variant}")
    verdict = run_case(
        broken, case, isolated=worker(f"attention_crossval.testing.broken.triton_fa:{variant}")
    )
    assert {f.check for f in verdict.findings} == {broken.expected_check}, verdict.findings
    with pytest.raises(CheckFailed, match=f"^{broken.expected_check}:"):
        verdict.raise_for(broken.expected_check)
    baseline = run_case(
        resolve("attention_crossval.testing.broken.triton_fa:correct"),
        case,
        isolated=worker("attention_crossval.testing.broken.triton_fa:correct"),
    )
    baseline.raise_for()
