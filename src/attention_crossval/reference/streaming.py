"""Tier 2: the FlashAttention online softmax in NumPy, with the kernel's precision chain.

The loop body of :func:`_attend_row_block` is the algorithm, one step per line
(docs/design.md#tier-2), so a reader can check it against a kernel's ``softmax`` /
``correction`` roles and a mutant can break one step at a time. Per query-row block and K/V
block (``c = scale_log2``)::

    S      = Q K^T                                   (masked entries -inf)
    S      = cap tanh(S scale / cap)                 (softcap only; then c = log2(e))
    m_new  = max(m_old, rowmax(S))                   (FA4: kept stale below the threshold)
    alpha  = exp2((m_old - m_new) * c)
    P      = exp2(S * c - m_new * c + offset)        (one FMA with a folded constant)
    l      = l * alpha + rowsum(P)
    O      = O * alpha + P V                         (P converted to p_dtype first)
    after the last block: O = O / l,  lse = (m * c + log2(l)) * ln 2 - offset * ln 2

FP8 inputs (docs/fp8.md): ``c`` carries ``q_descale k_descale``, S is the product of the raw
FP8 values, ``offset = max_offset_log2`` scales P into the FP8 range before its satfinite
conversion (0 otherwise), and the final O is multiplied by ``v_descale``. With
``mma_accumulator_bits`` both products run through the FP8 MMA's narrow accumulator
(:mod:`reference.mma`).

Before the first block ``m = -inf, l = 0, O = 0``; with a sink ``sigma`` (a logit with no value)
``m = sigma log2(e) / c, l = exp2(sigma log2(e) - m c) = 1, O = 0``: the sink is the state the
loop starts from, so a row that sees no key ends with ``O = 0`` and ``lse = sigma``.

Memory is O(block_m * block_n + outputs): the full score matrix is never formed.
"""

from __future__ import annotations

import numpy as np

from attention_crossval.reference.case import FP8_DTYPES, AttentionCase, AttentionResult
from attention_crossval.reference.masks import visible
from attention_crossval.reference.mma import mma_product
from attention_crossval.reference.precision import (
    LN_2,
    LOG2_E,
    StreamingPrecision,
    fp8_max,
    round_to,
)


class TraceRecorder:
    """Null recorder: the loop calls these hooks unconditionally; this one keeps nothing."""

    def start(self, case: AttentionCase) -> None:
        """Called once before the first block."""

    def block(
        self,
        b: int,
        h: int,
        rows: slice,
        seen: np.ndarray,
        m_old: np.ndarray,
        m_block: np.ndarray,
        m_new: np.ndarray,
    ) -> None:
        """Called after the running max of one (row block, K block) tile was updated."""

    def clamped(self, b: int, h: int, rows: slice, count: np.ndarray) -> None:
        """Called per tile with an FP8 P: ``count[r]`` P elements of row r were clamped."""


class RescaleTrace(TraceRecorder):
    """Per-row record of the running-max updates, so a property can prove that an adversarial
    case really forced repeated rescaling (and a threshold really skipped some).

    Fields after a run, each ``int [B, Hq, Sq]``:

    * ``rescales``: times the running max was raised after the row's first visible block
      (each one rescales O and row_sum by alpha < 1).
    * ``max_raises``: times the running max was raised, the first visible block included.
    * ``visible_blocks``: K blocks with at least one key visible to the row; 0 = empty row.
    * ``skipped_rescales``: blocks whose max exceeded the running max but stayed within
      ``rescale_threshold_log2``, so the stale max was kept (always 0 with threshold 0).
    * ``clamped_p``: P elements above the largest finite value of an FP8 ``p_dtype``, which
      its satfinite conversion clamped (always 0 with a 16-bit P or none).
    """

    def start(self, case: AttentionCase) -> None:
        shape = (case.B, case.Hq, case.Sq)
        self.rescales = np.zeros(shape, np.int64)
        self.max_raises = np.zeros(shape, np.int64)
        self.visible_blocks = np.zeros(shape, np.int64)
        self.skipped_rescales = np.zeros(shape, np.int64)
        self.clamped_p = np.zeros(shape, np.int64)

    def clamped(self, b, h, rows, count) -> None:
        self.clamped_p[b, h, rows] += count

    def block(self, b, h, rows, seen, m_old, m_block, m_new) -> None:
        raised = m_new > m_old
        self.max_raises[b, h, rows] += raised
        self.rescales[b, h, rows] += raised & (m_old > -np.inf)
        self.visible_blocks[b, h, rows] += seen.any(axis=1)
        self.skipped_rescales[b, h, rows] += (m_block > m_old) & ~raised


_NO_TRACE = TraceRecorder()
FLOAT64_PRECISION = StreamingPrecision.float64()  # the default: the algorithm without rounding


def streaming_attention(
    case: AttentionCase,
    precision: StreamingPrecision = FLOAT64_PRECISION,
    *,
    block_m: int = 128,
    block_n: int = 128,
    reverse_kv_order: bool = False,
    trace: TraceRecorder | None = None,
) -> AttentionResult:
    """Online-softmax attention over ``block_m x block_n`` tiles with ``precision``'s chain.

    Returns ``o [B, Sq, Hq, Dv]`` (float64 holding values of ``precision.output_dtype``, or of
    the accumulator dtype when that is None) and ``lse [B, Hq, Sq]`` (natural log). Empty rows,
    padded query rows included, give ``O = 0`` and ``lse = -inf``. ``reverse_kv_order`` visits
    K blocks last to first, as FA4 does. ``trace`` (e.g. :class:`RescaleTrace`) is filled in.
    Padding (queries past ``q_lengths``, keys past ``k_lengths``) is never read, as in a kernel.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not isinstance(precision, StreamingPrecision):
        raise ValueError(f"precision must be a StreamingPrecision, got {type(precision).__name__}")
    trace = _NO_TRACE if trace is None else trace
    if not isinstance(trace, TraceRecorder):
        raise ValueError(f"trace must be a RescaleTrace (or None), got {type(trace).__name__}")
    trace.start(case)
    o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
    lse = np.full((case.B, case.Hq, case.Sq), -np.inf)  # empty rows, padded queries included
    if case.sink is not None:  # ... have the sink as their LSE
        lse[:] = case.sink[None, :, None]
    for b in range(case.B):
        # Blocks stop at the valid key length, so padded K/V (possibly NaN) is never multiplied.
        k_len = case.k_length(b)
        col_blocks = [slice(n0, min(n0 + block_n, k_len)) for n0 in range(0, k_len, block_n)]
        if reverse_kv_order:
            col_blocks.reverse()
        for h in range(case.Hq):
            for m0 in range(0, case.q_length(b), block_m):
                rows = slice(m0, min(m0 + block_m, case.q_length(b)))
                O, lse_rows = _attend_row_block(case, b, h, rows, col_blocks, precision, trace)
                o[b, rows, h, :] = round_to(O, precision.output_dtype or precision.accum_dtype)
                lse[b, h, rows] = lse_rows
    return AttentionResult(o=o, lse=lse)


def _attend_row_block(
    case: AttentionCase,
    b: int,
    h: int,
    rows: slice,
    col_blocks: list[slice],
    precision: StreamingPrecision,
    trace: TraceRecorder,
) -> tuple[np.ndarray, np.ndarray]:
    """One query-row block against every K/V block: unnormalized-O loop, then O / row_sum.

    Arrays live in ``score_dtype`` (S, P, row_max) or ``accum_dtype`` (O, row_sum); a float32
    matmul of the exact 16-bit or fp32 inputs stands for the MMA (BLAS summation order is not a
    specification: the derived bound covers any order, docs/numerics.md#summation-order).
    """
    score_dtype, accum_dtype = np.dtype(precision.score_dtype), np.dtype(precision.accum_dtype)
    scale_log2 = score_dtype.type(LOG2_E * case.softmax_scale)  # c = fl(log2(e) * softmax_scale)
    if case.softcap is not None:  # the scale goes inside the cap: exp2 takes log2(e) alone
        cap, scale = score_dtype.type(case.softcap), score_dtype.type(case.softmax_scale)
        scale_log2 = score_dtype.type(LOG2_E)  # c = log2(e)
    # Raise the max only when it grows by more than the threshold (log2 units -> score units).
    kv_head = case.kv_head(h)
    if case.descaled:  # FP8: c = fl(c fl(q_descale k_descale)); S stays Q K^T of raw values
        descale = score_dtype.type(case.descale("q", b, kv_head) * case.descale("k", b, kv_head))
        scale_log2 = scale_log2 * descale
        if case.softcap is not None:
            scale = scale * descale
    threshold = score_dtype.type(precision.rescale_threshold_log2 / scale_log2)
    offset = score_dtype.type(precision.max_offset_log2)  # P scaled by 2^offset (FP8 range)
    fp8_p = precision.p_dtype in FP8_DTYPES
    narrow_mma = precision.mma_accumulator_bits  # None: both MMAs accumulate in fp32
    Q = case.q[b, rows, h, :].astype(score_dtype)
    row_max = np.full(Q.shape[0], -np.inf, score_dtype)  # m = -inf: no key seen yet
    row_sum = np.zeros(Q.shape[0], accum_dtype)  # l = 0
    if case.sink is not None:  # start from the sink: m = sigma log2(e) / c, l = 1
        row_max[:] = score_dtype.type(case.sink[h]) * score_dtype.type(LOG2_E) / scale_log2
        row_sum[:] = 1
        row_sum *= np.exp2(offset)  # the sink's P carries the offset too
    O = np.zeros((Q.shape[0], case.Dv), accum_dtype)  # O = 0 (unnormalized)
    for cols in col_blocks:
        K = case.k[b, cols, kv_head, :].astype(score_dtype)
        seen = visible(case, b, h, rows, cols)
        V = case.v[b, cols, kv_head, :].astype(accum_dtype)
        V = np.where(seen.any(axis=0)[:, None], V, 0)  # keys no row sees: never read (may be NaN)
        S = Q @ K.T if narrow_mma is None else mma_product(Q, K.T, precision)  # S = Q K^T
        if case.softcap is not None:
            S = cap * np.tanh(S * scale / cap)  # S = cap tanh(S scale / cap)
        S = np.where(seen, S, -np.inf)  # masked scores are -inf, so exp2 gives P = 0
        m_old = row_max
        m_block = S.max(axis=1)  # rowmax(S)
        row_max = np.maximum(m_old, m_block)  # m_new = max(m_old, rowmax(S))
        row_max = np.where(row_max > m_old + threshold, row_max, m_old)  # FA4: keep a stale max
        m_safe = np.where(row_max == -np.inf, 0, row_max)  # rows empty so far: no -inf - -inf
        alpha = np.exp2((m_old - m_safe) * scale_log2).astype(accum_dtype)  # exp2((m_old-m_new)*c)
        P = np.exp2(
            _fma(S, scale_log2, (offset - m_safe * scale_log2)[:, None])
        )  # exp2(S*c - m*c + off)
        P_mma = round_to(P, precision.p_dtype or precision.score_dtype)  # P as fed to P V
        if fp8_p:  # satfinite clamped the P above the format's largest value
            trace.clamped(b, h, rows, (P > fp8_max(precision.p_dtype)).sum(axis=1))
        P_sum = P_mma if precision.row_sum_from_rounded_p else P  # which P row_sum adds
        row_sum = row_sum * alpha + P_sum.sum(axis=1, dtype=accum_dtype)  # l = l*alpha + rowsum(P)
        if narrow_mma is None:
            O = O * alpha[:, None] + P_mma.astype(accum_dtype) @ V  # O = O * alpha + P V
        else:  # the FP8 MMA's narrow accumulator, from O * alpha (docs/fp8.md)
            O = mma_product(P_mma, V, precision, initial=O * alpha[:, None])
        trace.block(b, h, rows, seen, m_old, m_block, row_max)
    # A non-empty row's max key adds exp2(~0) ~ 1 (exactly 1 but for the FMA residual
    # S*c - fl(m*c)), so row_sum > 0; an empty row's row_sum is 0.
    row_sum_safe = np.where(row_sum > 0, row_sum, 1)  # empty rows: O stays 0, no 0 / 0
    O = O / row_sum_safe[:, None]  # O = O / row_sum (deferred normalization)
    if case.v_descale is not None:  # O = v_descale (P V_raw) / row_sum
        O = O * accum_dtype.type(case.descale("v", b, kv_head))
    # lse = (m * c + log2(l)) * ln 2; empty rows: -inf * c + log2(1) = -inf.
    lse = (row_max.astype(accum_dtype) * scale_log2 + np.log2(row_sum_safe)) * LN_2
    lse = lse - accum_dtype.type(offset * LN_2)  # l carries 2^offset
    return O, lse.astype(np.float64)


def _fma(a: np.ndarray, b: np.floating, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` in ``a``'s dtype, as the kernel's FFMA (float64 mode: multiply, then add).

    For float32 the product is exact in float64 and the sum is rounded twice (float64, then
    float32), which differs from one FMA rounding only when the float64 sum lands on a float32
    tie.
    """
    return (a.astype(np.float64) * np.float64(b) + c).astype(a.dtype)
