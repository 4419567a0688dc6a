"""A kernel's precision chain, and rounding to 16-bit formats without double rounding.

``StreamingPrecision`` is what the streaming tier emulates and what ``bounds`` derives its
tolerance from, so a kernel declares its chain once and both follow it.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from attention_crossval.reference.case import (
    FP8_DTYPES,
    INPUT_DTYPES,
    WIDE_DTYPES,
    dtype_name,
    is_int,
)

LOG2_E = math.log2(math.e)  # scale_log2 = LOG2_E * softmax_scale: the constant folded into exp2
LN_2 = math.log(2.0)  # natural-log LSE = log2-domain LSE * LN_2

_ROUNDING_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


def fp8_max(dtype: str) -> float:
    """Largest finite value of an FP8 format: 448 (e4m3fn), 57344 (e5m2)."""
    return float(ml_dtypes.finfo(INPUT_DTYPES[dtype]).max)


def round_to(x: np.ndarray, dtype: str, *, flush_subnormals: bool = False) -> np.ndarray:
    """Round ``x`` to ``dtype`` (round to nearest even) and return it as float64 values.

    float64 -> bfloat16 is done on the float64 bits: ml_dtypes before 0.7 goes through float32
    and double rounds (docs/numerics.md#rounding). float32 input converts directly. Values
    beyond the dtype's range become +-inf, silently: a kernel's output overflows the same way
    (regression: properties/test_streaming.py::test_round_to_overflows_to_inf_without_a_warning).
    FP8 formats convert with satfinite, as the FP8 MMA operands do: beyond the largest finite
    value the result is +-max (448 or 57344), not NaN or inf; NaN stays NaN.
    ``flush_subnormals``: a result below the format's smallest normal becomes zero of the same
    sign, as a conversion in flush-to-zero mode gives (a kernel's may, the format cannot say).
    """
    if dtype not in _ROUNDING_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(_ROUNDING_DTYPES)}")
    x = np.asarray(x)
    if flush_subnormals:
        rounded = round_to(x, dtype)
        tiny = float(ml_dtypes.finfo(_ROUNDING_DTYPES[dtype]).smallest_normal)
        return np.where(np.abs(rounded) < tiny, np.copysign(0.0, rounded), rounded)
    if dtype in FP8_DTYPES:  # satfinite: clamp, then round to nearest even (cannot overflow)
        top = fp8_max(dtype)
        return np.clip(x, -top, top).astype(_ROUNDING_DTYPES[dtype]).astype(np.float64)
    if dtype == "bfloat16" and x.dtype == np.float64:
        return _round_float64_to_bfloat16(x)
    with np.errstate(over="ignore"):  # beyond the dtype's range is +-inf, as IEEE rounding gives
        return x.astype(_ROUNDING_DTYPES[dtype]).astype(np.float64)


def cast_input(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as an array of the input dtype ``dtype`` (``reference.case.INPUT_DTYPES``),
    rounded once to nearest even. float64 -> bfloat16 goes through :func:`round_to`: ml_dtypes
    before 0.7 rounded through float32 (twice), 0.7 rounds directly, so a plain ``astype`` made
    a recipe's inputs depend on the installed version (one value in 76,800 of a ramp recipe).
    FP8 formats saturate (:func:`round_to`)."""
    x = np.asarray(x)
    if dtype in FP8_DTYPES:  # satfinite, as quantizers convert (e4m3fn has no inf)
        return round_to(x, dtype).astype(INPUT_DTYPES[dtype])
    if dtype == "bfloat16" and x.dtype == np.float64:
        x = round_to(x, "bfloat16")  # bf16 values: the cast below is exact
    with np.errstate(over="ignore"):  # beyond the range is +-inf, as round_to gives
        return x.astype(INPUT_DTYPES[dtype])


def _round_float64_to_bfloat16(x: np.ndarray) -> np.ndarray:
    # Round to 8 significant bits on the float64 bits (RNE), then let ml_dtypes handle the range
    # (overflow to inf): the float32 step is then exact except below bf16's normal range.
    bits = np.array(x, dtype=np.float64, order="C").view(np.uint64)  # keeps 0-d arrays 0-d
    finite = np.isfinite(x)
    shift = np.uint64(45)
    half = np.uint64(1) << (shift - np.uint64(1))
    lsb = (bits >> shift) & np.uint64(1)
    rounded = ((bits + half - np.uint64(1) + lsb) >> shift) << shift
    rounded = np.where(finite, rounded, bits).view(np.float64)
    # Below bf16's normal range the spacing is fixed at 2^-133: round on that grid (RNE).
    tiny = np.abs(x) < 2.0**-126
    rounded = np.where(tiny, np.round(x * 2.0**133) * 2.0**-133, rounded)
    with np.errstate(over="ignore"):  # beyond bf16's range the answer is inf, as intended
        return rounded.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


MMA_ROUNDINGS = ("truncate", "nearest")
# Significant bits Hopper's FP8 WGMMA keeps while it accumulates (docs/fp8.md#mma-accumulation):
# 13 fraction bits and the leading one: DeepSeek-V3's "about 14 bits", the FP22 (e8m13) reported.
HOPPER_FP8_MMA_BITS = 14


@dataclass(frozen=True)
class StreamingPrecision:
    """Precision of each stage of a FlashAttention-style forward pass.

    * ``score_dtype``: S = Q K^T accumulation and the exp2 argument (``float32`` or ``float64``).
    * ``p_dtype``: P rounded to this before P V (``float16``/``bfloat16``), or None to keep it.
    * ``row_sum_from_rounded_p``: row_sum adds the rounded P (True) or the unrounded p (False).
    * ``accum_dtype``: O and row_sum accumulators (``float32`` or ``float64``).
    * ``output_dtype``: final O rounding, or None to return the accumulator's values.
    * ``rescale_threshold_log2``: raise the running max only when it grows by more than this many
      log2 units (FA4 uses 8 for 16-bit inputs; 0 = always).
    * ``max_offset_log2``: P is computed as ``exp2(S c - m c + max_offset_log2)``, i.e. scaled
      by ``2^max_offset`` into an FP8 format's range before the conversion; row sum and O carry
      the same factor, which cancels in O / row_sum (0 = no offset; docs/fp8.md).
    * ``mma_accumulator_bits``: significant bits (the leading one included) the tensor core
      keeps while it sums FP8 products, Hopper's FP8 WGMMA (docs/fp8.md#mma-accumulation);
      None = IEEE fp32 accumulation. Each MMA step aligns its terms to the largest one's
      exponent, cuts them to this many bits and cuts the sum again (:mod:`reference.mma`).
    * ``mma_accumulator_rounding``: how those bits are cut: ``truncate`` (toward zero, what
      the measurements describe) or ``nearest`` (to nearest even).
    * ``mma_promotion_interval``: products summed inside the tensor core (from zero) before
      the partial sum is added into the fp32 accumulator by an ordinary fp32 addition
      (Triton's ``max_num_imprecise_acc``); None = never: the accumulator itself enters every
      MMA step, across the head dimension (S) and every K block (O).

    With an FP8 ``p_dtype`` P converts with satfinite (:func:`round_to`): a stale max lets the
    scaled P reach ``2^(max_offset + threshold)``, which clamps when that exceeds the format's
    largest value (:attr:`can_saturate`).
    """

    score_dtype: str = "float32"
    p_dtype: str | None = None
    row_sum_from_rounded_p: bool = False
    accum_dtype: str = "float32"
    output_dtype: str | None = None
    rescale_threshold_log2: float = 0.0
    max_offset_log2: float = 0.0
    mma_accumulator_bits: int | None = None
    mma_accumulator_rounding: str = "truncate"
    mma_promotion_interval: int | None = None

    def __post_init__(self) -> None:
        for name in ("score_dtype", "accum_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "float64"):
                raise ValueError(f"{name}={value!r} must be 'float32' or 'float64'")
        p_dtypes = ("float16", "bfloat16", *FP8_DTYPES)
        if self.p_dtype is not None and self.p_dtype not in p_dtypes:
            raise ValueError(f"p_dtype={self.p_dtype!r} must be None or one of {list(p_dtypes)}")
        if self.output_dtype is not None and self.output_dtype not in WIDE_DTYPES:
            raise ValueError(
                f"output_dtype={self.output_dtype!r} must be None or one of {list(WIDE_DTYPES)}"
            )
        if not isinstance(self.row_sum_from_rounded_p, (bool, np.bool_)):
            raise ValueError(
                f"row_sum_from_rounded_p={self.row_sum_from_rounded_p!r} must be a bool"
            )
        self._check_threshold()
        self._check_offset()
        self._check_mma_accumulator()

    def _check_mma_accumulator(self) -> None:
        """The narrow accumulator is an FP8 MMA's (p_dtype FP8) with fp32 stages around it."""
        bits, interval = self.mma_accumulator_bits, self.mma_promotion_interval
        if self.mma_accumulator_rounding not in MMA_ROUNDINGS:
            raise ValueError(
                f"mma_accumulator_rounding={self.mma_accumulator_rounding!r} must be one of "
                f"{list(MMA_ROUNDINGS)}"
            )
        if bits is None:
            if interval is not None:
                raise ValueError(
                    f"mma_promotion_interval={interval!r} needs mma_accumulator_bits (None: "
                    "the MMA accumulates in fp32 and nothing is promoted)"
                )
            return
        if not is_int(bits) or not 4 <= bits <= 24:
            raise ValueError(
                f"mma_accumulator_bits={reprlib.repr(bits)} must be None or an int in [4, 24] "
                "(significant bits; 24 is fp32's)"
            )
        fp32 = self.score_dtype == self.accum_dtype == "float32"
        if self.p_dtype not in FP8_DTYPES or not fp32:
            raise ValueError(
                f"mma_accumulator_bits={bits} models an FP8 MMA: it needs an FP8 p_dtype and "
                f"float32 scores and accumulators, got p_dtype={self.p_dtype!r}, "
                f"score_dtype={self.score_dtype!r}, accum_dtype={self.accum_dtype!r}"
            )
        if interval is not None and (not is_int(interval) or interval < 1):
            raise ValueError(
                f"mma_promotion_interval={reprlib.repr(interval)} must be None or an int >= 1 "
                "(products per partial sum)"
            )
        object.__setattr__(self, "mma_accumulator_bits", int(bits))
        if interval is not None:
            object.__setattr__(self, "mma_promotion_interval", int(interval))

    def _check_offset(self) -> None:
        """``max_offset_log2``: a finite float in (-64, 64): P scaled by ``2^+-64`` and more
        leaves every FP8 range, and the float32 stages keep it exact only well inside theirs
        (a negative offset scales P down, as a kernel folding a descale below 1 into P does)."""
        offset = self.max_offset_log2
        rule = "must be a finite float in (-64, 64) (log2 units)"
        if isinstance(offset, bool) or not isinstance(offset, (int, float, np.floating)):
            raise ValueError(f"max_offset_log2={reprlib.repr(offset)} {rule}")
        if not -64 < float(offset) < 64:
            raise ValueError(f"max_offset_log2={reprlib.repr(offset)} {rule}")
        object.__setattr__(self, "max_offset_log2", float(offset))

    def _check_threshold(self) -> None:
        """A stale max lets P reach ``2^threshold``: at or beyond the exponent range of the
        narrowest stage (128 for float32, 1024 for float64) P itself overflows, which no
        kernel can declare (every tier raised OverflowError at ``10**400``)."""
        threshold = self.rescale_threshold_log2
        limit = 1024 if self.score_dtype == self.accum_dtype == "float64" else 128
        rule = f"must be a finite float in [0, {limit}) (log2 units; {limit}: P overflows)"
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)):
            raise ValueError(f"rescale_threshold_log2={reprlib.repr(threshold)} {rule}")
        try:
            value = float(threshold)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        if not 0 <= value < limit:
            raise ValueError(f"rescale_threshold_log2={reprlib.repr(threshold)} {rule}")
        object.__setattr__(self, "rescale_threshold_log2", value)

    @classmethod
    def float64(cls) -> StreamingPrecision:
        """Every stage in float64, no rounding of P or O: the tier's 'exact algorithm' mode."""
        return cls(score_dtype="float64", accum_dtype="float64")

    @classmethod
    def flash_attention(
        cls, input_dtype: str, *, rescale_threshold_log2: float = 0.0
    ) -> StreamingPrecision:
        """FlashAttention's chain for ``input_dtype`` inputs: fp32 S and accumulators, P rounded
        to the input dtype before P V, row_sum from the fp32 p, O rounded to the input dtype.
        FP8 inputs: :meth:`fp8_attention` with offset 8 and threshold 0 (FA3's constants: P
        at most 256, never clamped) and a bf16 output."""
        input_dtype = dtype_name(input_dtype)
        if input_dtype in FP8_DTYPES:
            return cls.fp8_attention(
                input_dtype, max_offset_log2=8.0, rescale_threshold_log2=rescale_threshold_log2
            )
        p_dtype = None if input_dtype == "float32" else input_dtype
        return cls(
            score_dtype="float32",
            p_dtype=p_dtype,
            row_sum_from_rounded_p=False,
            accum_dtype="float32",
            output_dtype=input_dtype,
            rescale_threshold_log2=rescale_threshold_log2,
        )

    @classmethod
    def fp8_attention(
        cls,
        input_dtype: str,
        *,
        max_offset_log2: float,
        rescale_threshold_log2: float,
        row_sum_from_rounded_p: bool = False,
        output_dtype: str = "bfloat16",
        mma_accumulator_bits: int | None = None,
        mma_promotion_interval: int | None = None,
    ) -> StreamingPrecision:
        """An FP8 forward's chain: fp32 S and accumulators, P scaled by ``2^max_offset_log2``
        and converted to the input's FP8 format (satfinite) before P V, the lazy rescale,
        O rounded to ``output_dtype``. The fixed constants keep ``max_offset_log2 +
        rescale_threshold_log2 <= log2(fp8 max)``; FA4's (8 and 4 with e4m3) do not.
        ``mma_accumulator_bits`` / ``mma_promotion_interval``: the FP8 MMA's narrow
        accumulator (:data:`HOPPER_FP8_MMA_BITS` on sm_90), truncating."""
        if input_dtype not in FP8_DTYPES:
            raise ValueError(f"input_dtype={input_dtype!r} must be one of {list(FP8_DTYPES)}")
        return cls(
            score_dtype="float32",
            p_dtype=input_dtype,
            row_sum_from_rounded_p=row_sum_from_rounded_p,
            accum_dtype="float32",
            output_dtype=output_dtype,
            rescale_threshold_log2=rescale_threshold_log2,
            max_offset_log2=max_offset_log2,
            mma_accumulator_bits=mma_accumulator_bits,
            mma_promotion_interval=mma_promotion_interval,
        )

    @property
    def can_saturate(self) -> bool:
        """True when P in an FP8 format can clamp: a stale max lets the scaled P reach
        ``2^(max_offset + threshold)``, above the format's largest finite value."""
        if self.p_dtype not in FP8_DTYPES:
            return False
        top = self.max_offset_log2 + self.rescale_threshold_log2
        return 2.0**top > fp8_max(self.p_dtype)

    @property
    def is_float64(self) -> bool:
        """True when nothing is rounded below float64 (results should match exact to ~1e-12)."""
        return (
            self.score_dtype == self.accum_dtype == "float64"
            and self.p_dtype is None
            and self.output_dtype is None
        )


DQ_ORDERS = ("fixed", "permuted")


@dataclass(frozen=True)
class BackwardPrecision:
    """Precision of each stage of a FlashAttention-style backward pass (dq, dk, dv).

    * ``forward``: the chain that produced the O and LSE the backward reads.
    * ``p_dtype``: P (recomputed from the LSE) rounded to this before ``dV += P^T dO``, or None.
    * ``ds_dtype``: dS rounded to this before ``dK += dS^T Q`` and ``dQ += dS K``, or None.
    * ``ds_from_rounded_p``: dS is formed from the P rounded to ``p_dtype`` (a kernel that keeps
      only the 16-bit P it fed to the dV MMA), not from the fp32 P (FlashAttention).
    * ``ds_scaled``: ``softmax_scale`` multiplies dS before it is rounded to ``ds_dtype``, so dq
      and dk need no scale at the end (measured in torch SDPA's efficient and cuDNN backends).
    * ``ds_flushes_subnormals``: dS's rounding to ``ds_dtype`` flushes a result below the
      format's smallest normal to zero (sign kept): a conversion or MMA in flush-to-zero mode
      (measured in torch SDPA's cuDNN backend).
    * ``dkv_rounded_per_head``: with GQA, each query head's dk/dv is rounded to ``output_dtype``
      before the group sum (in ``accum_dtype``, then rounded again): a kernel that writes
      per-head gradients and reduces them afterwards (FlashAttention 2's GQA backward).
    * ``accum_dtype``: S, dP, D, the elementwise P/dS math and every accumulator
      (``float32`` or ``float64``).
    * ``dq_order``: how the K blocks' dQ partials are added: ``fixed`` (K blocks in order, a
      deterministic kernel) or ``permuted`` (a seeded random order, as atomic adds land).
    * ``output_dtype``: final dq/dk/dv rounding, or None to return the accumulator's values.
    """

    forward: StreamingPrecision = StreamingPrecision()
    p_dtype: str | None = None
    ds_dtype: str | None = None
    ds_from_rounded_p: bool = False
    ds_scaled: bool = False
    ds_flushes_subnormals: bool = False
    dkv_rounded_per_head: bool = False
    accum_dtype: str = "float32"
    dq_order: str = "fixed"
    output_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.forward, StreamingPrecision):
            raise ValueError(
                f"forward must be a StreamingPrecision, got {type(self.forward).__name__}"
            )
        for name in ("p_dtype", "ds_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float16", "bfloat16"):
                raise ValueError(f"{name}={value!r} must be None, 'float16' or 'bfloat16'")
        flags = ("ds_from_rounded_p", "ds_scaled", "ds_flushes_subnormals", "dkv_rounded_per_head")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.ds_flushes_subnormals and self.ds_dtype is None:
            raise ValueError(
                "ds_flushes_subnormals=True needs a ds_dtype (it describes dS's rounding to it)"
            )
        if self.accum_dtype not in ("float32", "float64"):
            raise ValueError(f"accum_dtype={self.accum_dtype!r} must be 'float32' or 'float64'")
        if self.dq_order not in DQ_ORDERS:
            raise ValueError(f"dq_order={self.dq_order!r} must be one of {list(DQ_ORDERS)}")
        if self.output_dtype is not None and self.output_dtype not in WIDE_DTYPES:
            raise ValueError(
                f"output_dtype={self.output_dtype!r} must be None or one of {list(WIDE_DTYPES)}"
            )

    @classmethod
    def float64(cls) -> BackwardPrecision:
        """Forward and backward in float64, nothing rounded: the tier's 'exact algorithm'."""
        return cls(forward=StreamingPrecision.float64(), accum_dtype="float64")

    @classmethod
    def flash_attention(cls, input_dtype: str, *, deterministic: bool = True) -> BackwardPrecision:
        """FlashAttention's chain for ``input_dtype`` inputs: its forward chain, P and dS rounded
        to the input dtype before their MMAs (fp32 inputs: not rounded), fp32 accumulators,
        dq/dk/dv rounded to the input dtype; dQ partials in K-block order when
        ``deterministic``, else in an atomic-add order."""
        input_dtype = dtype_name(input_dtype)
        mma_dtype = None if input_dtype == "float32" else input_dtype
        return cls(
            forward=StreamingPrecision.flash_attention(input_dtype),
            p_dtype=mma_dtype,
            ds_dtype=mma_dtype,
            accum_dtype="float32",
            dq_order="fixed" if deterministic else "permuted",
            output_dtype=input_dtype,
        )

    @property
    def is_float64(self) -> bool:
        """True when nothing, forward included, is rounded below float64."""
        return (
            self.forward.is_float64
            and self.accum_dtype == "float64"
            and self.p_dtype is None
            and self.ds_dtype is None
            and self.output_dtype is None
        )
