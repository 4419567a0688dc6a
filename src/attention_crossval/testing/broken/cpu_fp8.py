"""CPU FP8 kernels (docs/fp8.md, docs/mutants.md): one correct, three with a real FP8 mistake.

Each is the streaming tier on 16 x 16 tiles; all declare the same correct chain
(:data:`FIXED`: e4m3 with max_offset 4 and threshold 4, e5m2 with 8 and 4, so the offset plus
the threshold stays within log2 of the FP8 maximum), since that is what an FP8 kernel promises:

* ``fp8_fixed``: computes that chain: passes.
* ``fa4_saturation``: FA4's constants (max_offset 8, threshold 4) with the row sum from the
  unclamped fp32 P: a stale max lets the scaled P reach 4096, e4m3 clamps it at 448, and O
  loses weight on its dominant keys while the LSE stays right.
* ``forgets_k_descale``: leaves k's descale out of the softmax scale.
* ``v_descale_in_p``: folds v's descale into P before P's FP8 conversion instead of applying
  it after the division: the same value in exact arithmetic, but a descale above 1 pushes P
  past the FP8 maximum (clamped) and one below 1 pushes small P into the subnormals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.parallel import unit_case
from attention_crossval.reference.precision import StreamingPrecision, round_to
from attention_crossval.reference.streaming import streaming_attention

TILE = 16
FIXED = {
    "float8_e4m3fn": StreamingPrecision.fp8_attention(
        "float8_e4m3fn", max_offset_log2=4.0, rescale_threshold_log2=4.0
    ),
    "float8_e5m2": StreamingPrecision.fp8_attention(
        "float8_e5m2", max_offset_log2=8.0, rescale_threshold_log2=4.0
    ),
}
FA4 = {dtype: dataclasses.replace(chain, max_offset_log2=8.0) for dtype, chain in FIXED.items()}
MISTAKES = ("fixed", "fa4_saturation", "forgets_k_descale", "v_descale_in_p")


def _spec(name: str) -> KernelSpec:
    return KernelSpec(
        name=name,
        dtypes=frozenset(FIXED),
        head_dims=frozenset({8, 16, 32, 64, 128}),
        mask_kinds=frozenset({"causal", "window", "varlen", "explicit"}),
        gqa=True,
        tile_m=TILE,
        tile_n=TILE,
        returns_lse=True,
        device="cpu",
        descales=True,
        precision=dict(FIXED),
    )


@dataclass
class Fp8Adapter:
    """The streaming tier on an FP8 case with ``mistake`` (one of :data:`MISTAKES`)."""

    mistake: str
    spec: KernelSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.mistake not in MISTAKES:
            raise ValueError(f"mistake={self.mistake!r} must be one of {list(MISTAKES)}")
        self.spec = _spec(f"cpu-fp8-{self.mistake.replace('_', '-')}")

    def __call__(self, case: AttentionCase) -> AttentionResult:
        chain = (FA4 if self.mistake == "fa4_saturation" else FIXED)[case.dtype]
        if self.mistake == "forgets_k_descale":
            case = dataclasses.replace(case, k_descale=None)
        if self.mistake == "v_descale_in_p" and case.v_descale is not None:
            return _v_descale_in_p(case, chain)
        return streaming_attention(case, chain, block_m=TILE, block_n=TILE)


def _v_descale_in_p(case: AttentionCase, chain: StreamingPrecision) -> AttentionResult:
    """Per (batch, kv head): P scaled by ``2^offset v_descale`` before its FP8 conversion (an
    offset of ``offset + log2 v_descale``, so the row sum carries the factor too), then O
    multiplied by ``v_descale`` to undo it there: O = fp8(P 2^offset vd) V / (l 2^offset)."""
    o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
    lse = np.zeros((case.B, case.Hq, case.Sq))
    group = case.group_size
    for b in range(case.B):
        for kvh in range(case.Hkv):
            heads = tuple(range(kvh * group, (kvh + 1) * group))
            sub = dataclasses.replace(unit_case(case, b, heads), v_descale=None)
            vd = case.descale("v", b, kvh)
            offset = chain.max_offset_log2 + float(np.log2(vd))
            folded = dataclasses.replace(chain, max_offset_log2=offset, output_dtype=None)
            part = streaming_attention(sub, folded, block_m=TILE, block_n=TILE)
            scaled = (part.o[0] * np.float32(vd)).astype(np.float32)  # the fp32 accumulator
            out = chain.output_dtype
            o[b, :, heads[0] : heads[-1] + 1] = scaled if out is None else round_to(scaled, out)
            lse[b, heads[0] : heads[-1] + 1] = part.lse[0]  # the folded offset is taken out
    return AttentionResult(o=o, lse=lse)


def fp8_fixed() -> Fp8Adapter:
    return Fp8Adapter("fixed")


def fa4_saturation() -> Fp8Adapter:
    return Fp8Adapter("fa4_saturation")


def forgets_k_descale() -> Fp8Adapter:
    return Fp8Adapter("forgets_k_descale")


def v_descale_in_p() -> Fp8Adapter:
    return Fp8Adapter("v_descale_in_p")
