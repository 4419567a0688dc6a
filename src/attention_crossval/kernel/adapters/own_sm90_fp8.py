"""The own SM90 kernel's FP8 forward (kernel/own/sm90/fwd.py with e4m3 or e5m2 inputs) on a Hopper
GPU: the adapter ``own-sm90-fp8`` and its launch.

Declared: ``float8_e4m3fn`` / ``float8_e5m2`` inputs with q/k/v descales (float32 per batch and
kv head; ones where a case has none), bf16 output, D = 64 or 128, GQA/MQA, bottom-right causal
or no mask (the kernel's dense path: no lengths, no window), LSE natural log. Its chain is
``StreamingPrecision.fp8_attention`` with the kernel's constants: fp32 S and accumulators, P
scaled by ``2^max_offset`` and converted to the input's FP8 format (satfinite, RNE), the lazy
rescale with ``rescale_threshold_log2``, the row sum from the unrounded fp32 P, O rounded once
to bf16, and both products in the FP8 WGMMA's narrow accumulator, never promoted: S chains the
head dimension's k32 WGMMAs and O is the accumulator of every key block's
(``mma_accumulator_bits``, docs/fp8.md#mma-accumulation).

Two sets of constants ``(max_offset_log2, rescale_threshold_log2)``:

* :data:`FIXED_CONSTANTS` (``own-sm90-fp8``): ``max_offset + threshold <= log2(fp8 max)`` per
  format, so P never clamps and the fp32 row sum matches the P that enters ``P V``;
* :data:`FA4_CONSTANTS` (:func:`create_fa4`, by dotted path only:
  ``--kernel attention_crossval.kernel.adapters.own_sm90_fp8:create_fa4``): flash-attn-4's
  offset 8 with threshold 4, a GPU fault kernel. With e4m3 P reaches ``2^12`` and clamps at 448
  while the row sum keeps the unclamped value: the suite must catch it (docs/own-kernels.md).

The launch reorders V on the device (:func:`keys_contiguous_v`): keys contiguous, as FP8 WGMMA
reads its shared-memory operands K-major, and in :func:`~kernel.sm90.fp8_layout.fp8_key_order`,
the order the kernel's P fragment needs, then calls the kernel through the own kernels' TVM-FFI
launch (kernel/adapters/_cute.py), as the 16-bit adapters do. The adapter runs the kernel with
:data:`KNOBS`. torch and cutlass are imported only inside calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from attention_crossval.kernel.adapters import _cute, _torch
from attention_crossval.kernel.adapters.own_sm90 import ROWS_PER_WG, TILE_N, consumer_warpgroups
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.precision import HOPPER_FP8_MMA_BITS, StreamingPrecision

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# (max_offset_log2, rescale_threshold_log2) per input dtype, their sum <= log2(fp8 max):
# e4m3 8 + 0 <= log2(448) = 8.8; e5m2 8 + 4 <= log2(57344) = 15.8 (the lazy rescale in use).
FIXED_CONSTANTS: dict[str, tuple[float, float]] = {
    "float8_e4m3fn": (8.0, 0.0),
    "float8_e5m2": (8.0, 4.0),
}
# flash-attn-4's SM100 FP8 constants before its fix: 8 + 4 = 12 > 8.8 with e4m3.
FA4_CONSTANTS: dict[str, tuple[float, float]] = dict.fromkeys(FP8_DTYPES, (8.0, 4.0))
# The FP8 kernel's knobs (kernel/own/sm90/fwd.py), as own_sm90.DEFAULT_KNOBS without smem_epilogue
# (bf16 O does not fit the FP8 Q buffer); m192 as there: 192-row tiles at D = 64.
KNOBS = ("overlap", "pingpong", "longest_first", "m192")


def fp8_spec(name: str, constants: dict[str, tuple[float, float]]) -> KernelSpec:
    """What the FP8 kernel implements, with the chain of ``constants`` per input dtype."""
    return KernelSpec(
        name=name,
        dtypes=frozenset(FP8_DTYPES),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal"}),
        gqa=True,
        tile_m=ROWS_PER_WG,
        tile_n=TILE_N,
        precision={
            dtype: StreamingPrecision.fp8_attention(
                dtype,
                max_offset_log2=offset,
                rescale_threshold_log2=threshold,
                mma_accumulator_bits=HOPPER_FP8_MMA_BITS,  # never promoted: WGMMA chains
            )
            for dtype, (offset, threshold) in constants.items()
        },
        descales=True,
        device="cuda",
        deterministic=True,
    )


@dataclass
class OwnSm90Fp8Adapter(_torch.GuardedOutputsAdapter):
    """Guard-banded FP8 inputs, bf16 ``o`` and fp32 ``lse`` prefilled and guard-banded; one
    reorder of V and one launch per call."""

    constants: dict[str, tuple[float, float]] = field(default_factory=lambda: FIXED_CONSTANTS)
    spec: KernelSpec = field(default_factory=lambda: fp8_spec("own-sm90-fp8", FIXED_CONSTANTS))

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        offset, threshold = self.constants[case.dtype]
        launch(
            q, k, v, out, lse, case.softmax_scale, causal=case.mask.causal,
            descales=descale_tensors(case, q.device), max_offset_log2=offset,
            rescale_threshold_log2=threshold, **dict.fromkeys(KNOBS, True),
        )  # fmt: skip


def descale_tensors(case: AttentionCase, device: Any) -> tuple[Any, Any, Any]:
    """q, k and v descales of ``case`` as float32 ``[B, Hkv]`` device tensors, ones where the
    case has none (the kernel then multiplies by 1, exactly)."""
    import numpy as np
    import torch

    ones = np.ones((case.B, case.Hkv), np.float32)
    return tuple(
        torch.from_numpy(np.array(ones if d is None else d, np.float32)).to(device)  # a copy
        for d in (case.q_descale, case.k_descale, case.v_descale)
    )


def keys_contiguous_v(v: Any) -> Any:
    """``v [B, Sk, Hkv, D]`` (FP8, any strides) as the FP8 kernel reads it: a new
    ``[B, Hkv, D, Sk']`` buffer viewed as ``[B, Sk', Hkv, D]`` (unit stride along the keys), with
    ``Sk'`` = :func:`~kernel.sm90.fp8_layout.padded_keys` and position ``j`` holding key
    ``fp8_key_order(Sk')[j]`` (zeros for keys past ``Sk``). Only ``v``'s valid rows are read."""
    import torch

    from attention_crossval.kernel.own.sm90.fp8_layout import fp8_key_order, padded_keys

    B, Sk, Hkv, D = v.shape
    keys = padded_keys(Sk)
    order = fp8_key_order(keys)
    held = (order < Sk).nonzero()[0]  # positions holding a real key
    bits = v.view(torch.uint8).permute(0, 2, 3, 1)  # [B, Hkv, D, Sk]; gathers need no FP8 kernel
    reordered = torch.zeros((B, Hkv, D, keys), dtype=torch.uint8, device=v.device)
    positions = torch.as_tensor(held, device=v.device)
    reordered[..., positions] = bits[..., torch.as_tensor(order[held], device=v.device)]
    return reordered.view(v.dtype).permute(0, 3, 1, 2)


def launch(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    *,
    causal: bool,
    descales: tuple[Any, Any, Any],
    max_offset_log2: float,
    rescale_threshold_log2: float,
    **knobs: bool,
) -> None:
    """Run the FP8 kernel on torch CUDA tensors ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``
    (one FP8 dtype), ``out`` bf16 like q, ``lse [B, Hq, Sq]`` fp32, ``descales`` (q, k, v)
    float32 ``[B, Hkv]``, on the current stream, through the own kernels' TVM-FFI launch
    (:func:`kernel.adapters._cute.launch`), V first copied keys-contiguous
    (:func:`keys_contiguous_v`). ``knobs`` (names from :data:`KNOBS`) pick the variant, off
    when left out; one compile per (dtype, D, causal, constants, knobs) and process."""
    import torch

    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"unknown knobs {unknown}: the FP8 kernel's are {list(KNOBS)}")
    dtype = str(q.dtype).removeprefix("torch.")
    if dtype not in FP8_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {FP8_DTYPES}: {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")  # fmt: skip
    if out.dtype != torch.bfloat16:
        raise ValueError(f"out.dtype={out.dtype} must be torch.bfloat16 (FP8 inputs write bf16)")
    B, Hkv = q.shape[0], k.shape[2]
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales, strict=True):
        if d.dtype != torch.float32 or tuple(d.shape) != (B, Hkv):
            raise ValueError(f"{name} must be float32 [B, Hkv] = [{B}, {Hkv}], got {d.dtype} "
                             f"{tuple(d.shape)}")  # fmt: skip
    if v.shape != k.shape:  # before the copy: _cute.launch sees the padded keys
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match")
    variant = (max_offset_log2, rescale_threshold_log2, *(n for n in KNOBS if knobs.get(n)))
    build = partial(_make_kernel, max_offset_log2, rescale_threshold_log2, knobs)
    _cute.launch(
        "own-sm90-fp8", build, q, k, keys_contiguous_v(v), out, lse, softmax_scale,
        causal=causal, gqa=True, variant=variant, descales=tuple(d.contiguous() for d in descales),
    )  # fmt: skip


def _make_kernel(
    max_offset_log2: float,
    rescale_threshold_log2: float,
    knobs: dict[str, bool],
    dtype: str,
    head_dim: int,
    causal: bool,
) -> Any:
    """The kernel object of one variant, for :func:`kernel.adapters._cute.launch` to compile."""
    from attention_crossval.kernel.own.sm90.fwd import FlashAttentionForwardSm90

    num_wg = consumer_warpgroups(head_dim, knobs.get("m192", False))
    return FlashAttentionForwardSm90(
        dtype, head_dim, causal, num_consumer_wg=num_wg, tile_n=TILE_N,
        max_offset_log2=max_offset_log2, rescale_threshold_log2=rescale_threshold_log2,
        **{name: on for name, on in knobs.items() if name != "m192"},
    )  # fmt: skip


def create() -> OwnSm90Fp8Adapter:
    """``own-sm90-fp8``: the fixed constants."""
    return OwnSm90Fp8Adapter()


def create_fa4() -> OwnSm90Fp8Adapter:
    """The same kernel with flash-attn-4's constants (a fault kernel, by dotted path only)."""
    return OwnSm90Fp8Adapter(
        constants=FA4_CONSTANTS, spec=fp8_spec("own-sm90-fp8-fa4", FA4_CONSTANTS)
    )
