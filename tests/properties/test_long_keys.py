"""The backward suite's long-key strategy (properties/_strategies/long_keys.py): what it draws,
the swamped-dQ claim, and that its cases catch a 16-bit dQ accumulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import find, settings

from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties.kernel_suite import backward_strategies
from attention_crossval.properties.strategies import (
    SWAMPED_DQ,
    drawn_examples,
    long_key_backward_cases,
)
from attention_crossval.reference.case import AttentionCase
from attention_crossval.testing.broken.cpu_backward_faults import BrokenBackwardAdapter


@pytest.mark.cpu
@pytest.mark.parametrize("which", ["streaming-fa", "cpu-backward"])
def test_long_keys_draw_many_key_blocks_mostly_swamped(which: str) -> None:
    """The backward suite's long-key strategy, for the CPU kernel and for the broken backward
    kernels' spec: every case has one or two queries over 1024+ keys and eight K blocks or
    more; at least half are the swamped pattern, whose claim holds; and every declared dtype
    is drawn. Counted over 40 derandomized draws."""
    spec = resolve("streaming-fa").spec if which == "streaming-fa" else BrokenBackwardAdapter().spec
    strategy = backward_strategies(spec)["long_keys"]
    cases = drawn_examples(strategy, 40)
    assert len(cases) == 40
    for case in cases:
        fwd = case.forward
        assert fwd.Sq <= 2 and fwd.Sk >= 1024 and -(-fwd.Sk // spec.tile_n) >= 8, fwd.describe()
    swamped = [c for c in cases if "dist=swamped_dq" in c.label]
    assert len(swamped) >= 20, [c.label for c in cases]
    for case in swamped:
        evidence = SWAMPED_DQ.claim(case.forward, spec.tile_n)
        assert evidence.failure is None and evidence.applicable > 0, evidence
    assert {c.forward.dtype for c in cases} == set(spec.dtypes)


@pytest.mark.cpu
def test_swamped_claim_rejects_a_gaussian_case() -> None:
    """The control: the claim fails where the keys and values carry no common sign."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 1, 16)).astype(np.float32) for n in (1, 64, 64))
    assert SWAMPED_DQ.claim(AttentionCase(q, k, v), 16).failure is not None


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swamped_long_keys_catch_a_16_bit_dq_accumulator(dtype: str) -> None:
    """A drawn swamped case over 1024 keys (the first such draw in ``dtype`` with a gaussian
    dO): the 16-bit dQ accumulator fails dq-bound and nothing else, the fp32 one passes."""
    spec = BrokenBackwardAdapter().spec
    strategy = long_key_backward_cases(spec=spec, max_head_dim=16, do_distributions=["gaussian"])
    case = find(
        strategy,
        lambda c: "dist=swamped_dq" in c.label and c.forward.dtype == dtype,
        settings=settings(database=None, deadline=None, derandomize=True),
    )
    run_backward_case(BrokenBackwardAdapter("none"), case, samples=1).raise_for()
    verdict = run_backward_case(BrokenBackwardAdapter("dq_16bit_accumulator"), case, samples=1)
    assert {f.check for f in verdict.findings} == {"dq-bound"}, case.label
