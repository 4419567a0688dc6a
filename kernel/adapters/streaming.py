"""The NumPy streaming tier as a CPU "virtual kernel": the default when no GPU exists.

It runs :func:`reference.streaming.streaming_attention` with its declared FlashAttention
precision chain, and :func:`reference.streaming_backward.streaming_backward` with FlashAttention's
deterministic backward chain, so the whole kernel pipeline (harness, properties, report) can be
exercised and demonstrated on a CPU-only machine, backward included. Its outputs are NumPy
arrays it allocates itself, so only the padding, determinism and finiteness checks apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.reference.streaming_backward import streaming_backward


def _spec() -> KernelSpec:
    return KernelSpec(
        name="streaming-fa",
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_dims=frozenset({16, 32, 64, 128}),
        head_dims_v=frozenset({16, 32, 64, 128}),
        mask_kinds=frozenset({"causal", "window", "varlen", "explicit"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=True,
        tile_m=64,
        tile_n=64,
        returns_lse=True,
        device="cpu",
        backward=True,
        backward_deterministic=True,
        softcap=True,
        sink=True,
    )


@dataclass
class StreamingAdapter:
    """``streaming_attention(case, spec.precision_for(dtype), block_m/n = spec tiles)``, and
    its backward with ``spec.backward_precision_for(dtype)``."""

    spec: KernelSpec = field(default_factory=_spec)
    checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})
    backward_checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return streaming_attention(
            case,
            self.spec.precision_for(case.dtype),
            block_m=self.spec.tile_m,
            block_n=self.spec.tile_n,
        )

    def backward(self, case: BackwardCase) -> Gradients:
        """The streaming backward, reading the O and LSE of this kernel's own forward."""
        return streaming_backward(
            case,
            self.spec.backward_precision_for(case.forward.dtype),
            block_m=self.spec.tile_m,
            block_n=self.spec.tile_n,
        )


def create() -> StreamingAdapter:
    return StreamingAdapter()
