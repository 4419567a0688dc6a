"""kernel/harness/verdict.py: the triage hint names a neighbouring precision chain that would pass.

The kernels here are the streaming tier run under one chain while declaring another: faithful
implementations with a wrong declaration, the case the hint exists for.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.verdict import Finding, chain_hint, neighbour_chains
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention

pytestmark = pytest.mark.cpu

BF16 = StreamingPrecision.flash_attention("bfloat16")


@dataclasses.dataclass
class MisdeclaredStreaming:
    """Declares FlashAttention's bf16 chain (row sum from the fp32 P) but computes ``actual``,
    its O then multiplied by ``o_factor`` (1: a faithful kernel of the ``actual`` chain)."""

    actual: StreamingPrecision
    o_factor: float = 1.0
    spec: KernelSpec = dataclasses.field(
        default_factory=lambda: KernelSpec(
            name="misdeclared",
            dtypes=frozenset({"bfloat16"}),
            head_dims=frozenset({16}),
            mask_kinds=frozenset(),
            device="cpu",
        )
    )

    def __call__(self, case: AttentionCase) -> AttentionResult:
        result = streaming_attention(case, self.actual, block_m=128, block_n=128)
        return dataclasses.replace(result, o=result.o * self.o_factor)


def _case() -> AttentionCase:
    """bf16, 512 keys with near-equal logits: P's bf16 rounding errors add up in the row sum."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 1, 16)) * 0.1
    k = rng.standard_normal((1, 512, 1, 16)) * 0.1
    v = rng.standard_normal((1, 512, 1, 16))
    return AttentionCase(*(np.asarray(a).astype("bfloat16") for a in (q, k, v)))


def test_kernel_summing_the_rounded_p_gets_the_hint() -> None:
    kernel = MisdeclaredStreaming(dataclasses.replace(BF16, row_sum_from_rounded_p=True))
    verdict = run_case(kernel, _case())
    assert "lse" in {f.check for f in verdict.findings}, verdict.findings
    hint = (
        "hint: would pass under the declared chain with row_sum_from_rounded_p=True: "
        "did the kernel sum the rounded P?"
    )
    assert all(hint in finding.message for finding in verdict.findings), verdict.findings


def test_faithful_kernel_passes_and_a_wrong_one_gets_no_hint() -> None:
    assert run_case(MisdeclaredStreaming(BF16), _case()).passed
    wrong = run_case(MisdeclaredStreaming(BF16, o_factor=2.0), _case())
    assert wrong.failed("bound"), wrong.findings
    assert not any("hint:" in finding.message for finding in wrong.findings), wrong.findings


def test_neighbours_and_the_first_chain_that_passes() -> None:
    changes = [change for _, change, _ in neighbour_chains(BF16, "bfloat16")]
    assert changes == ["row_sum_from_rounded_p=True", "p_dtype=None"]
    unrounded = StreamingPrecision.flash_attention("float32")
    assert [c for _, c, _ in neighbour_chains(unrounded, "float16")] == [
        "p_dtype='float16', row_sum_from_rounded_p=False",
        "p_dtype='float16', row_sum_from_rounded_p=True",
    ]
    assert neighbour_chains(unrounded, "float32") == []
    fp8 = StreamingPrecision.fp8_attention(
        "float8_e4m3fn", max_offset_log2=4.0, rescale_threshold_log2=4.0
    )
    assert [c for _, c, _ in neighbour_chains(fp8, "float8_e4m3fn")][-1] == (
        "mma_accumulator_bits=14"
    )
    hopper = dataclasses.replace(fp8, mma_accumulator_bits=14, mma_promotion_interval=32)
    assert [c for _, c, _ in neighbour_chains(hopper, "float8_e4m3fn")] == changes
    spec = KernelSpec(name="k", dtypes=frozenset({"bfloat16"}))
    failing = [Finding("lse", "outside")]
    assert chain_hint(spec, "bfloat16", lambda other: failing) is None
    passes_unrounded = lambda other: [] if other.precision["bfloat16"].p_dtype is None else failing  # noqa: E731
    assert "p_dtype=None" in chain_hint(spec, "bfloat16", passes_unrounded)
