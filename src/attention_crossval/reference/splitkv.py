"""Split-KV in the streaming tier: partial O and LSE per split of the keys, then a combine.

A split-KV kernel (flash_attn.cute's ``num_splits``) gives each of ``num_splits`` CTAs a range of
whole K blocks, runs the online softmax there (:func:`reference.streaming._attend_row_block`,
unchanged) and writes a normalized partial ``O_s`` and ``LSE_s`` in the accumulator dtype. A
combine step merges them, per query row::

    m      = max_s LSE_s                      (every split empty: m = -inf)
    w_s    = exp(LSE_s - m)                   (an empty split: LSE_s = -inf, w_s = 0)
    LSE    = m + log(sum_s w_s)
    O      = sum_s (w_s / sum_s w_s) O_s      (every split empty: O = 0, LSE = -inf)

Split ``s`` takes K blocks ``[s * per_split, (s + 1) * per_split)`` with ``per_split =
ceil(n_blocks / num_splits)`` of the batch's valid keys, so boundaries fall on tile edges and
trailing splits may see no key at all. The derived bound covers the combine through
``num_splits`` (``reference.bounds``). A sink enters split 0 only (its starting state there),
so it is counted once; with split 0 empty, that split's ``LSE_0`` is the sink.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision, round_to
from attention_crossval.reference.streaming import (
    FLOAT64_PRECISION,
    TraceRecorder,
    _attend_row_block,
)


def split_blocks(k_length: int, block_n: int, num_splits: int) -> list[list[slice]]:
    """The K blocks (slices of key positions) of each of ``num_splits`` splits; trailing
    splits may be empty lists."""
    blocks = [slice(n0, min(n0 + block_n, k_length)) for n0 in range(0, k_length, block_n)]
    per_split = -(-len(blocks) // num_splits) if blocks else 0
    return [blocks[s * per_split : (s + 1) * per_split] for s in range(num_splits)]


def combine(o_parts: np.ndarray, lse_parts: np.ndarray, dtype: np.dtype) -> tuple:
    """``(O [r, Dv], LSE [r])`` from partials ``O_s [S, r, Dv]`` and ``LSE_s [S, r]`` in
    ``dtype`` (module docstring)."""
    lse_parts = lse_parts.astype(dtype)
    lse_max = lse_parts.max(axis=0)  # m = max_s LSE_s
    m_safe = np.where(lse_max == -np.inf, 0, lse_max)  # every split empty: no -inf - -inf
    weights = np.exp(lse_parts - m_safe)  # w_s = exp(LSE_s - m); 0 for an empty split
    total = weights.sum(axis=0)  # sum_s w_s
    total_safe = np.where(total > 0, total, 1)  # every split empty: O stays 0
    lse = np.where(total > 0, m_safe + np.log(total_safe), -np.inf)  # LSE = m + log sum_s w_s
    o = ((weights / total_safe)[:, :, None] * o_parts).sum(axis=0)  # O = sum_s w_s O_s / sum w
    return o.astype(dtype), lse.astype(np.float64)


def splitkv_attention(
    case: AttentionCase,
    precision: StreamingPrecision = FLOAT64_PRECISION,
    *,
    block_m: int = 128,
    block_n: int = 128,
    num_splits: int = 1,
    combine_partials: Callable[[np.ndarray, np.ndarray, np.dtype], tuple] = combine,
    trace: TraceRecorder | None = None,
) -> AttentionResult:
    """:func:`reference.streaming.streaming_attention` split over the keys into ``num_splits``
    partial results and combined by ``combine_partials`` (:func:`combine`; a deliberately
    broken CPU kernel in ``kernel/broken`` swaps in its own); ``num_splits = 1`` is the plain
    loop. ``trace`` records the running-max updates of every split (a split's first block
    is no rescale)."""
    for name, value in (("block_m", block_m), ("block_n", block_n), ("num_splits", num_splits)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not isinstance(precision, StreamingPrecision):
        raise ValueError(f"precision must be a StreamingPrecision, got {type(precision).__name__}")
    without_sink = dataclasses.replace(case, sink=None)  # splits after the first
    accum = np.dtype(precision.accum_dtype)
    trace = TraceRecorder() if trace is None else trace
    trace.start(case)
    o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
    lse = np.full((case.B, case.Hq, case.Sq), -np.inf)  # empty rows, padded queries included
    if case.sink is not None:  # ... have the sink as their LSE
        lse[:] = case.sink[None, :, None]
    for b in range(case.B):
        splits = split_blocks(case.k_length(b), block_n, num_splits)
        for h in range(case.Hq):
            for m0 in range(0, case.q_length(b), block_m):
                rows = slice(m0, min(m0 + block_m, case.q_length(b)))
                parts = [
                    _attend_row_block(
                        case if s == 0 else without_sink, b, h, rows, blocks, precision, trace
                    )
                    for s, blocks in enumerate(splits)
                ]
                o_parts = np.stack([part[0] for part in parts])  # partial O_s, accumulator dtype
                lse_parts = np.stack([part[1] for part in parts])  # partial LSE_s
                O, lse[b, h, rows] = combine_partials(o_parts, lse_parts, accum)
                o[b, rows, h, :] = round_to(O, precision.output_dtype or precision.accum_dtype)
    return AttentionResult(o=o, lse=lse)
