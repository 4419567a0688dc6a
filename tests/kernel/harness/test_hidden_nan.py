"""NaN at hidden positions: keys no query sees, through causal, window or explicit masks as well
as padding. The references never read them, and the opt-in ``hidden-nan`` harness check
(kernel/harness/hidden_nan.py) finds a kernel that reads them and weights them by 0."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import find as hypothesis_find
from hypothesis import given, settings

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.hidden_nan import CHECK, hidden_nan_findings, poison_hidden
from attention_crossval.properties._strategies.hidden import hidden_key_cases, masked_hidden_keys
from attention_crossval.properties.strategies import REFERENCE_SPEC, attention_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment, Mask
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.masks import hidden_keys, visible_all
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.testing.mutants_surface import load_surface_mutant

pytestmark = pytest.mark.cpu

CLEAN_HIDDEN_CASES = hidden_key_cases(attention_cases(), spec=REFERENCE_SPEC, poison=False)


class _Kernel(StreamingAdapter):
    """streaming-fa on the reference spec's tiles (small, so cases span several K blocks)."""

    attention = staticmethod(streaming_attention)

    def __call__(self, case: AttentionCase) -> AttentionResult:
        with np.errstate(all="ignore"):
            return self.attention(
                case, block_m=REFERENCE_SPEC.tile_m, block_n=REFERENCE_SPEC.tile_n
            )


class _ReadsHiddenV(_Kernel):
    """Broken: loads V of keys no query sees and multiplies it by a zero weight."""

    attention = staticmethod(load_surface_mutant("hidden_v_read").streaming_attention)


def _top_left_case() -> AttentionCase:
    """Top-left causal with Sk > Sq: keys 3..19 are hidden from every query by the mask."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float16)
    k, v = (rng.standard_normal((1, 20, 1, 4)).astype(np.float16) for _ in range(2))
    return AttentionCase(q, k, v, mask=Mask(causal=True, alignment=CausalAlignment.TOP_LEFT))


@given(attention_cases(max_len=20))
def test_hidden_keys_are_the_keys_no_query_sees(case: AttentionCase) -> None:
    seen = visible_all(case)  # [B, Hq, Sq, Sk]
    group = case.group_size
    for kv in range(case.Hkv):
        expected = ~seen[:, kv * group : (kv + 1) * group].any(axis=(1, 2))
        assert np.array_equal(hidden_keys(case)[:, :, kv], expected)


def test_case_accepts_nan_at_hidden_keys_only() -> None:
    case = _top_left_case()
    poisoned = poison_hidden(case)
    assert np.isnan(poisoned.k[0, 3:].astype(np.float32)).all()
    assert np.isfinite(poisoned.k[0, :3].astype(np.float32)).all()
    k = np.array(case.k)
    k[0, 2, 0, 0] = np.nan  # key 2 is visible to query 2
    with pytest.raises(ValueError, match=r"k must be finite .* at k\[0, 2, 0, 0\]"):
        AttentionCase(case.q, k, case.v, mask=case.mask)


@given(CLEAN_HIDDEN_CASES)
def test_references_never_read_hidden_keys(case: AttentionCase) -> None:
    """Bitwise the same results with NaN at every hidden key: float64 and emulated streaming,
    and the exact tier."""
    poisoned = poison_hidden(case)
    assert masked_hidden_keys(case).any()
    chain = StreamingPrecision.flash_attention(case.dtype)
    with np.errstate(all="ignore"):
        for precision in (StreamingPrecision.float64(), chain):
            clean = streaming_attention(case, precision, block_m=16, block_n=8)
            dirty = streaming_attention(poisoned, precision, block_m=16, block_n=8)
            assert np.array_equal(clean.o, dirty.o) and np.array_equal(clean.lse, dirty.lse)
        clean, dirty = exact_attention(case), exact_attention(poisoned)
    assert np.array_equal(clean.o, dirty.o) and np.array_equal(clean.lse, dirty.lse)


@given(CLEAN_HIDDEN_CASES)
def test_a_kernel_that_never_reads_hidden_keys_passes(case: AttentionCase) -> None:
    kernel = _Kernel()
    assert hidden_nan_findings(case, kernel(case), kernel) == []


def test_a_kernel_that_reads_hidden_keys_is_found() -> None:
    case, broken = _top_left_case(), _ReadsHiddenV()
    assert hidden_nan_findings(case, _Kernel()(case), _Kernel()) == []
    (finding,) = hidden_nan_findings(case, broken(case), broken)
    assert finding.check == CHECK and "17 K/V rows that no query sees" in finding.message


def test_the_strategy_finds_the_broken_kernel() -> None:
    """Hidden-key cases reach the bug within the ci budget (the shrunk example is printed)."""
    broken = _ReadsHiddenV()
    found = hypothesis_find(
        CLEAN_HIDDEN_CASES,
        lambda case: bool(hidden_nan_findings(case, broken(case), broken)),
        settings=settings(max_examples=60, database=None),
    )
    assert masked_hidden_keys(found).any()


def test_a_case_without_hidden_keys_runs_nothing() -> None:
    case = _top_left_case()
    full = AttentionCase(case.q, case.k, case.v)  # no mask: every key is seen

    def run(_: AttentionCase) -> AttentionResult:
        raise AssertionError("the kernel must not run again")

    assert hidden_nan_findings(full, _Kernel()(full), run) == []


def test_the_harness_runs_the_opt_in_check() -> None:
    """run_case applies ``hidden-nan`` to an adapter that names it in ``checks``, and only then."""
    opted_in = frozenset({"hidden-nan", "determinism", "nonfinite"})
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 20, 1, 16)).astype(np.float16) for _ in range(2))
    case = AttentionCase(q, k, v, mask=Mask(causal=True, window_left=2))  # keys 0..14 hidden
    verdict = run_case(_ReadsHiddenV(checks=opted_in), case, compare=False)
    assert {f.check for f in verdict.findings} == {CHECK}, verdict
    opted_out = opted_in - {"hidden-nan"}
    assert run_case(_ReadsHiddenV(checks=opted_out), case, compare=False).findings == ()
    assert run_case(_Kernel(checks=opted_in), case).findings == ()
