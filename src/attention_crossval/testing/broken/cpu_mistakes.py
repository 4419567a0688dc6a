"""CPU kernels with one kernel author's mistake each, for the failure output a user meets: the
replay command, the report's exit status and first screen, and the findings' likely-cause hints.

``no_causal_mask`` declares causal masks and ignores them (every query sees every key);
``wrong_row_sum`` divides each row by a row sum 1/16 too large (the right max, the wrong sum).
Both are the streaming tier with 16 x 16 tiles and its FlashAttention chain otherwise, so the
mistake is the only thing wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention

ROW_SUM_SLIP = 1.0 + 2.0**-4  # wrong_row_sum's factor on every row sum


def _spec(name: str) -> KernelSpec:
    return KernelSpec(
        name=name,
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_dims=frozenset({8, 16, 32, 64}),
        mask_kinds=frozenset({"causal"}),
        tile_m=16,
        tile_n=16,
        returns_lse=True,
        device="cpu",
    )


@dataclass
class MistakenAdapter:
    """The streaming tier with ``mistake`` ("no_causal_mask" or "wrong_row_sum")."""

    mistake: str
    spec: KernelSpec = field(init=False)

    def __post_init__(self) -> None:
        self.spec = _spec(f"cpu-{self.mistake.replace('_', '-')}")

    def __call__(self, case: AttentionCase) -> AttentionResult:
        if self.mistake == "no_causal_mask":
            case = dataclasses.replace(case, mask=dataclasses.replace(case.mask, causal=False))
        precision = StreamingPrecision.flash_attention(case.dtype)
        result = streaming_attention(case, precision, block_m=16, block_n=16)
        if self.mistake == "wrong_row_sum":
            o = (result.o / ROW_SUM_SLIP).astype(result.o.dtype)
            return AttentionResult(o=o, lse=result.lse + np.log(ROW_SUM_SLIP))
        return result


def no_causal_mask() -> MistakenAdapter:
    return MistakenAdapter("no_causal_mask")


def wrong_row_sum() -> MistakenAdapter:
    return MistakenAdapter("wrong_row_sum")
