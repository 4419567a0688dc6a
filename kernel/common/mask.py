"""Masks on a register tile of scores, in CuTe DSL.

The predicate is the one of ``reference.masks.visible`` restricted to what the project's own
kernels declare: key ``j`` is visible to query row ``i`` iff ``j < seqlen_k`` and, when causal
(bottom-right, FlashAttention's alignment), ``j <= i + seqlen_k - seqlen_q``. Masked scores become
``-inf`` before the row max, so they contribute exactly 0 to the row sum and to ``P @ V``.

Tiles are addressed by coordinates: ``coords`` holds the ``(row, col)`` of every score element
inside its ``tile_m x tile_n`` tile (an identity tensor partitioned like the accumulator and
viewed as ``(rows, cols)`` like the scores), so the helpers do not depend on the MMA's register
layout and serve the SM90 (registers) and SM100 (TMEM loads) kernels alike.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def kv_block_range(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
) -> tuple[Int32, Int32]:
    """``(n_block_max, n_block_unmasked)`` for query tile ``m_block``.

    KV blocks ``0 .. n_block_max - 1`` hold every key visible to some row of the tile (0 when the
    whole tile is empty, e.g. causal with ``seqlen_q > seqlen_k``); blocks below
    ``n_block_unmasked`` are visible to every row of the tile and need no mask.
    """
    n_blocks_k = (seqlen_k + tile_n - 1) // tile_n
    n_block_max = n_blocks_k
    n_block_unmasked = seqlen_k // tile_n
    if cutlass.const_expr(causal):
        # Last visible key of the tile's last row: (m_block + 1) * tile_m - 1 + seqlen_k - seqlen_q.
        last_end = (m_block + 1) * tile_m + seqlen_k - seqlen_q
        n_block_max = cutlass.min(n_blocks_k, (cutlass.max(last_end, 0) + tile_n - 1) // tile_n)
        # Keys visible to the tile's first row: j < m_block * tile_m + 1 + seqlen_k - seqlen_q.
        first_end = m_block * tile_m + 1 + seqlen_k - seqlen_q
        n_block_unmasked = cutlass.min(n_block_unmasked, cutlass.max(first_end, 0) // tile_n)
    return n_block_max, n_block_unmasked


@cute.jit
def key_limit(
    row: Int32, seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr[bool]
) -> Int32:
    """Query row ``row`` sees exactly the keys ``j < key_limit`` (may be <= 0: an empty row)."""
    limit = seqlen_k
    if cutlass.const_expr(causal):
        limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q)
    return limit


@cute.jit
def apply_mask(
    scores: cute.Tensor,
    coords: cute.Tensor,
    row_offset: Int32,
    col_offset: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
) -> None:
    """Set invisible scores to ``-inf`` in place.

    ``scores`` and ``coords`` are ``(rows, cols)`` views of one thread's fragment; the absolute
    position of element ``(r, c)`` is ``(row_offset, col_offset) + coords[r, c]``.
    """
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        row = row_offset + coords[r, 0][0]
        col_limit = key_limit(row, seqlen_q, seqlen_k, causal) - col_offset
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            if coords[r, c][1] >= col_limit:
                scores[r, c] = -cutlass.Float32.inf
