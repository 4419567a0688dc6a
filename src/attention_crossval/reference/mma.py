"""An FP8 MMA whose accumulator keeps fewer bits than fp32, as Hopper's FP8 WGMMA does.

The model (docs/fp8.md#mma-accumulation): one MMA step sums :data:`MMA_STEP` products and,
when it continues a chain, the incoming accumulator. Its terms are aligned to the exponent of
the largest one and each is cut to ``bits`` significant bits on that grid (every term loses
what lies below ``2^(E + 1 - bits)``, ``2^E <= max |term| < 2^(E + 1)``); the aligned terms add
exactly and the sum is cut once more to ``bits`` significant bits. ``promotion`` products (a
chain of steps from zero) make one partial sum that an ordinary fp32 addition (round to
nearest) adds into the fp32 accumulator; with ``promotion=None`` the accumulator itself
enters every step. Products of FP8 values (and of P in FP8 with V in FP8) are exact in
float64, and so is every aligned sum: its terms are integers below ``2^bits`` times one grid.
"""

from __future__ import annotations

import numpy as np

from attention_crossval.reference.precision import StreamingPrecision

MMA_STEP = 32  # products per FP8 WGMMA instruction (k = 32 for 8-bit operands on sm_90)


def mma_product(
    a: np.ndarray, b: np.ndarray, precision: StreamingPrecision, initial: np.ndarray | None = None
) -> np.ndarray:
    """``initial + a @ b`` (``a [r, L]``, ``b [L, n]``, float32 ``initial`` or zeros) as
    ``precision``'s narrow MMA accumulator computes it (module docstring), in float32.
    ``precision.mma_accumulator_bits`` must be set: without it the MMA is a float32 matmul."""
    bits = precision.mma_accumulator_bits
    if bits is None:
        raise ValueError("precision.mma_accumulator_bits is None: the MMA accumulates in fp32")
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    start = np.zeros((a.shape[0], b.shape[1]), np.float32) if initial is None else initial
    truncate = precision.mma_accumulator_rounding == "truncate"
    interval = precision.mma_promotion_interval
    if interval is None:  # one chain from the initial value: the accumulator enters every step
        chained = _chain(a, b, 0, a.shape[1], np.asarray(start, np.float64), bits, truncate)
        return chained.astype(np.float32)  # exact: at most 24 significant bits
    acc = np.asarray(start, np.float32)
    zero = np.zeros(acc.shape)
    for g0 in range(0, a.shape[1], interval):  # each partial sum from zero, then one fp32 add
        partial = _chain(a, b, g0, min(g0 + interval, a.shape[1]), zero, bits, truncate)
        acc = acc + partial.astype(np.float32)  # the conversion is exact, the addition rounds
    return acc


def _chain(a, b, start: int, stop: int, acc: np.ndarray, bits: int, truncate: bool):
    """Products ``start:stop`` of ``a @ b`` summed by MMA steps onto ``acc`` (float64 values)."""
    for k0 in range(start, stop, MMA_STEP):
        k1 = min(k0 + MMA_STEP, stop)
        terms = a[:, k0:k1, None] * b[None, k0:k1, :]  # [r, step, n], exact
        acc = aligned_sum(np.concatenate([acc[:, None, :], terms], axis=1), bits, truncate)
    return acc


def aligned_sum(terms: np.ndarray, bits: int, truncate: bool) -> np.ndarray:
    """Sum of ``terms`` along axis 1 as one MMA step: each term cut to ``bits`` significant
    bits on the grid of the largest one's exponent, the exact sum cut to ``bits`` again."""
    top = np.max(np.abs(terms), axis=1, keepdims=True)
    _, exponent = np.frexp(np.where(top > 0, top, 1.0))  # top = f 2^exponent, 0.5 <= f < 1
    grid = np.ldexp(1.0, exponent - bits)  # 2^(E + 1 - bits) with E = exponent - 1
    total = (_cut(terms / grid, truncate)).sum(axis=1) * grid[:, 0]  # integers: exact
    return round_significant(total, bits, truncate)


def round_significant(x: np.ndarray, bits: int, truncate: bool) -> np.ndarray:
    """``x`` with ``bits`` significant bits: cut toward zero or rounded to nearest even."""
    fraction, exponent = np.frexp(x)
    return np.ldexp(_cut(np.ldexp(fraction, bits), truncate), exponent - bits)


def _cut(x: np.ndarray, truncate: bool) -> np.ndarray:
    return np.trunc(x) if truncate else np.rint(x)
