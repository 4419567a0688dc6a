"""The NumPy streaming tier as a CPU "virtual kernel": the default when no GPU exists.

It runs :func:`reference.streaming.streaming_attention` with its declared FlashAttention
precision chain, and :func:`reference.streaming_backward.streaming_backward` with FlashAttention's
deterministic backward chain, so the whole kernel pipeline (harness, properties, report) can be
exercised and demonstrated on a CPU-only machine, backward included. Its outputs are NumPy
arrays it allocates itself, so only the padding, hidden-NaN, determinism and finiteness checks
apply.

It declares every call option, so they run on CPU in ``pytest -m cpu``: a case with options
goes sequence by sequence through :func:`kernel.contract.call_options.per_sequence`, q from the
packed
rows, K/V through the shuffled, NaN-poisoned page table or the packed rows, each sequence split
over ``num_splits`` partial results and combined (:func:`reference.splitkv.splitkv_attention`).
Like a kernel API it refuses lengths that disagree with its tensors
(:func:`kernel.contract.length_checks.check_lengths`, ``spec.validates_lengths``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from attention_crossval.kernel.contract.call_options import (
    packed_layout,
    paged_layout,
    per_sequence,
)
from attention_crossval.kernel.contract.length_checks import check_lengths
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.paged import PagedKV
from attention_crossval.reference.splitkv import combine, splitkv_attention
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.reference.streaming_backward import streaming_backward
from attention_crossval.reference.varlen import PackedVarlen


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
        paged=True,
        max_splits=16,
        layouts=frozenset({"padded", "packed"}),
        validates_lengths=True,
    )


@dataclass
class StreamingAdapter:
    """``streaming_attention(case, spec.precision_for(dtype), block_m/n = spec tiles)``, per
    sequence through the layouts for a case with call options, and its backward with
    ``spec.backward_precision_for(dtype)``. ``combine`` is the split-KV combine and
    ``layouts(case)`` builds the packed and paged layouts: a broken kernel in ``kernel/broken``
    swaps one of them."""

    spec: KernelSpec = field(default_factory=_spec)
    checks: frozenset[str] = frozenset({"padding-read", "hidden-nan", "determinism", "nonfinite"})
    backward_checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})
    combine: Callable[[np.ndarray, np.ndarray, np.dtype], tuple] = combine

    def __call__(self, case: AttentionCase) -> AttentionResult:
        check_lengths(case)  # as a kernel API does before it trusts them
        precision = self.spec.precision_for(case.dtype)
        blocks = dict(block_m=self.spec.tile_m, block_n=self.spec.tile_n)
        if not case.call_options:
            return streaming_attention(case, precision, **blocks)
        packed, paged = self.layouts(case)
        return per_sequence(
            case,
            lambda sequence: splitkv_attention(
                sequence,
                precision,
                num_splits=case.num_splits,
                combine_partials=self.combine,
                **blocks,
            ),
            packed=packed,
            paged=paged,
        )

    def layouts(self, case: AttentionCase) -> tuple[PackedVarlen | None, PagedKV | None]:
        """The packed and paged layouts the kernel reads (None where the case has none)."""
        return packed_layout(case), paged_layout(case)

    def backward(self, case: BackwardCase) -> Gradients:
        """The streaming backward, reading the O and LSE of this kernel's own forward."""
        check_lengths(case.forward)
        return streaming_backward(
            case,
            self.spec.backward_precision_for(case.forward.dtype),
            block_m=self.spec.tile_m,
            block_n=self.spec.tile_n,
        )


def create() -> StreamingAdapter:
    return StreamingAdapter()
