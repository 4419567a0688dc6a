"""A small Triton FP8 forward (``_triton_fp8_kernel.py``) with FA4's two constants, right or wrong.

FA4's FP8 forward scales P by ``2^max_offset`` into the FP8 range and keeps a stale row max while
it grows by at most ``rescale_threshold`` (log2 units), so P reaches ``2^(max_offset +
threshold)``; P is converted satfinite for ``P V`` while the row sum adds the fp32 P
(docs/fp8.md). Two adapters run the same kernel:

* ``triton-fp8`` (:func:`fixed`): constants with ``max_offset + threshold <= log2(fp8 max)``
  (:data:`FIXED`), so P never clamps; it must pass the kernel suite.
* ``triton-fp8-fa4`` (:func:`fa4_constants`): FA4's 8 and 4 with e4m3, where P reaches 4096 and
  clamps at 448 while the row sum keeps 4096: the dominant keys of a row whose max creeps up by
  just under the threshold lose weight and O is wrong, LSE right. It declares the chain of
  :func:`fixed` (the precision an FP8 kernel with FA4's lazy threshold should have: declaring
  FA4's own constants makes the bound of every row that can clamp undefined, which no element
  check can fail) and must be caught on ``bound``. e5m2 is left out: FA4's constants fit it
  (2^12 <= 57344), they are :func:`fixed`'s.

Both take e4m3/e5m2 Q, K, V with per-(batch, kv head) float32 descales, GQA, bottom-right causal
and varlen lengths, write bf16 O and a natural-log LSE. V is handed over transposed with its keys
contiguous (:func:`keys_last`), as an FP8 WGMMA on sm_90 needs its B operand. Both dots add
every :data:`PROMOTION_INTERVAL` products of the FP8 WGMMA's narrow accumulator into fp32
(Triton's ``max_num_imprecise_acc``), and both adapters declare that accumulator
(``mma_accumulator_bits``, docs/fp8.md#mma-accumulation): without it both failed ``lse`` on
one value on the H200; with it, its kernel suite passes there (docs/results-h200.md).
``scripts/gpu/fp8_check.py`` is the H200 check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, CausalAlignment, Mask
from attention_crossval.reference.precision import (
    HOPPER_FP8_MMA_BITS,
    LOG2_E,
    StreamingPrecision,
    fp8_max,
    round_to,
)

BLOCK_M, BLOCK_N = 64, 64
# (max_offset_log2, rescale_threshold_log2) per input dtype. FIXED keeps offset + threshold
# within log2 of the format's largest value (log2 448 = 8.8, log2 57344 = 15.8) and keeps FA4's
# lazy threshold of 4, so the two adapters differ in e4m3's offset alone.
FIXED = {"float8_e4m3fn": (4.0, 4.0), "float8_e5m2": (8.0, 4.0)}
FA4 = {"float8_e4m3fn": (8.0, 4.0)}
# Products per partial sum of the FP8 WGMMA's narrow accumulator, added into fp32 (the kernel's
# max_num_imprecise_acc; below 32 Triton gives up the FP8 WGMMA).
PROMOTION_INTERVAL = 32
# FA4's trigger as scripts/gpu/fp8_check.py runs it, (dtype, creep_case arguments): e4m3 with a
# rise just under the threshold, slower, and with more heads; e5m2, where FA4's constants fit
# (triton-fp8-fa4 declines it). 16 K blocks each: the row max climbs to 50 log2 units at most,
# and the bound of Hopper's narrow accumulator still sees FA4's clamp (1.5-2.2 times the bound,
# emulated); at 4096 keys and more its worst case on such logits hides it
# (docs/fp8.md#mma-accumulation).
TRIGGERS = (
    ("float8_e4m3fn", dict(Sk=1024, D=128, rise_log2=3.5, causal=True)),
    ("float8_e4m3fn", dict(Sk=1024, D=64, rise_log2=3.9)),
    ("float8_e4m3fn", dict(Sk=1024, D=128, rise_log2=2.0, Sq=200, Hq=4, seed=1)),
    ("float8_e4m3fn", dict(Sk=1024, D=128, rise_log2=3.0, causal=True, seed=2)),
    ("float8_e5m2", dict(Sk=1024, D=128, rise_log2=3.5, causal=True)),
)


@dataclass
class TritonFp8Adapter(_torch.GuardedOutputsAdapter):
    """The Triton FP8 kernel with one set of constants per input dtype."""

    spec: KernelSpec
    constants: dict[str, tuple[float, float]]
    expected_check: str | None = None

    @classmethod
    def create(
        cls,
        name: str,
        constants: dict[str, tuple[float, float]],
        expected_check: str | None = None,
        *,
        declared: dict[str, tuple[float, float]] | None = None,
    ) -> TritonFp8Adapter:
        """Run ``constants``; declare the chain of ``declared`` (default: ``constants``)."""
        precision = {
            dtype: StreamingPrecision.fp8_attention(
                dtype,
                max_offset_log2=offset,
                rescale_threshold_log2=threshold,
                mma_accumulator_bits=HOPPER_FP8_MMA_BITS,
                mma_promotion_interval=PROMOTION_INTERVAL,
            )
            for dtype, (offset, threshold) in (declared or constants).items()
        }
        spec = KernelSpec(
            name=name,
            dtypes=frozenset(constants),
            head_dims=frozenset({32, 64, 128}),  # an FP8 WGMMA reduces 32 at a time
            mask_kinds=frozenset({"causal", "varlen"}),
            causal_alignment=CausalAlignment.BOTTOM_RIGHT,
            tile_m=BLOCK_M,
            tile_n=BLOCK_N,
            precision=precision,
            padded_rows="unwritten",
            descales=True,
        )
        return cls(spec, dict(constants), expected_check)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        from attention_crossval.testing.broken._triton_fp8_kernel import attention_fp8_fwd

        offset, threshold = self.constants[case.dtype]
        device = q.device
        lengths = [
            _torch.int32_tensor([length(b) for b in range(case.B)], device)
            for length in (case.q_length, case.k_length)
        ]
        descales = [_torch.float32_tensor(descales_of(case, name), device) for name in "qkv"]
        vt = keys_last(v)
        grid = (max(1, math.ceil(case.Sq / BLOCK_M)), case.B * case.Hq)
        attention_fp8_fwd[grid](
            q, k, vt, out, lse, *lengths, *descales,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            vt.stride(0), vt.stride(1), vt.stride(2), out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            case.Hq, case.Hkv, case.group_size, case.softmax_scale * math.log2(math.e),
            MAX_OFFSET=offset, THRESHOLD=threshold, P_MAX=fp8_max(case.dtype),
            IMPRECISE_ACC=PROMOTION_INTERVAL,
            CAUSAL="causal" in case.mask.kinds, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=case.D,
        )  # fmt: skip


def descales_of(case: AttentionCase, name: str) -> list[list[float]]:
    """``case``'s ``q``/``k``/``v`` descale as ``[B][Hkv]`` float32 values (1 where it has none)."""
    return [[case.descale(name, b, h) for h in range(case.Hkv)] for b in range(case.B)]


def keys_last(v: Any, *, guard: int = _torch.GUARD) -> Any:
    """V ``[B, S, Hkv, D]`` copied to ``[B, Hkv, D, S]`` with the keys contiguous (K-major for
    the ``P V`` WGMMA), inside a NaN guard band along the keys as :func:`_torch.to_device`
    puts around the other inputs."""
    import torch

    B, S, H, D = v.shape
    buf = torch.full((B, H, D, S + 2 * guard), float("nan"), dtype=v.dtype, device=v.device)
    view = buf[..., guard : guard + S]
    view.copy_(v.permute(0, 2, 3, 1))
    return view


def creep_case(
    dtype: str = "float8_e4m3fn",
    *,
    Sq: int = 64,
    Sk: int = 1024,
    D: int = 64,
    Hq: int = 2,
    Hkv: int = 1,
    rise_log2: float = 3.5,
    causal: bool = False,
    seed: int = 0,
) -> AttentionCase:
    """FA4's trigger: logits with std about 1 on a ramp whose max rises by ``rise_log2`` (log2
    units, just under the threshold of 4) per K block of :data:`BLOCK_N` keys, so a lazy rescale
    keeps a stale max every other block. Q, K and V are quantized per (batch, kv head) to
    ``dtype`` by their largest magnitude, as a real quantizer scales them (the descales)."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(D)
    q = rng.standard_normal((1, Sq, Hq, D))
    k = rng.standard_normal((1, Sk, Hkv, D))
    noise = (scale * math.sqrt(D - 1)) ** -0.5  # q.k over the other D - 1 coordinates: std ~1
    q[..., 1:] *= noise
    k[..., 1:] *= noise
    q[..., 0] = 1.0
    k[..., 0] = (rise_log2 * np.arange(Sk) / BLOCK_N / (scale * LOG2_E))[None, :, None]
    v = rng.standard_normal((1, Sk, Hkv, D))
    (q, q_descale), (k, k_descale), (v, v_descale) = (quantize(x, dtype, Hkv) for x in (q, k, v))
    return AttentionCase(
        q, k, v,
        mask=Mask(causal=causal),
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        label=f"creep {rise_log2:g}/block",
    )  # fmt: skip


def quantize(x: np.ndarray, dtype: str, Hkv: int) -> tuple[np.ndarray, np.ndarray]:
    """``x [B, S, H, X]`` divided by its float32 descale per (batch, kv head), ``amax / fp8
    max`` over the heads sharing the kv head, and converted satfinite to FP8 ``dtype``."""
    B, S, H, X = x.shape
    amax = np.abs(x).reshape(B, S, Hkv, H // Hkv, X).max(axis=(1, 3, 4))
    descale = (np.where(amax > 0, amax, 1.0) / fp8_max(dtype)).astype(np.float32)
    per_head = np.repeat(descale.astype(np.float64), H // Hkv, axis=1)[:, None, :, None]
    return round_to(x / per_head, dtype).astype(INPUT_DTYPES[dtype]), descale


def fixed() -> TritonFp8Adapter:
    """``triton-fp8``: the constants that never clamp P (:data:`FIXED`)."""
    return TritonFp8Adapter.create("triton-fp8", FIXED)


def fa4_constants() -> TritonFp8Adapter:
    """``triton-fp8-fa4``: FA4's e4m3 constants, which clamp P (:data:`FA4`), under the chain
    of :data:`FIXED`: caught on ``bound``."""
    declared = {dtype: FIXED[dtype] for dtype in FA4}
    return TritonFp8Adapter.create("triton-fp8-fa4", FA4, "bound", declared=declared)
