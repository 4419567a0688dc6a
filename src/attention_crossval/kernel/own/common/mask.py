"""Masks on a register tile of scores, in CuTe DSL.

The predicate is the one of ``reference.masks.visible`` restricted to what the project's own
kernels declare. With ``offset = seqlen_k - seqlen_q`` (bottom-right, FlashAttention's alignment;
the batch's valid lengths under varlen), key ``j`` is visible to query row ``i`` iff
``j < seqlen_k`` and

* causal: ``j <= i + offset`` (a window's right side is then irrelevant: it is >= 0);
* a window: ``i + offset - window_left <= j <= i + offset + window_right``.

Masked scores become ``-inf`` (assigned, so a NaN score of a padded key is replaced too) before
the row max, so they contribute exactly 0 to the row sum and to ``P @ V``.

Window bounds are runtime ``Int32`` values or ``None`` (unbounded, a compile-time choice). The
caller clamps them to ``[0, seqlen_q]`` (right) and ``[0, seqlen_k]`` (left) of the padded extents:
wider bounds see the same keys, and the clamp keeps every sum here inside int32.

Tiles are addressed by coordinates: ``coords`` holds the ``(row, col)`` of every score element
inside its ``tile_m x tile_n`` tile (an identity tensor partitioned like the accumulator and
viewed as ``(rows, cols)`` like the scores), so the helpers do not depend on the MMA's register
layout and serve the SM90 (registers) and SM100 (TMEM loads) kernels alike.

The block and key arithmetic (:func:`kv_block_range`, :func:`key_range`,
:func:`block_needs_mask`, :func:`split_by_mask`, :func:`padded_key_rows`) is plain Python
without branches on values: at trace time it takes the kernel's ``Int32`` values and emits their
arithmetic, and the CPU tests run the same functions on Python ints
(tests/kernel/test_own_kernels.py). Every division has a non-negative dividend: ``//`` on a DSL
``Int32`` truncates toward zero, unlike Python's floor.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def _right_bound(causal: bool, window_right: Int32 | None) -> Int32 | int | None:
    """How far right of the diagonal a row sees: 0 when causal, the window's side, or None."""
    return 0 if causal else window_right


def kv_block_range(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: int,
    tile_n: int,
    causal: bool,
    window_left: Int32 | None = None,
    window_right: Int32 | None = None,
) -> tuple[Int32, Int32, Int32, Int32]:
    """``(n_block_min, n_block_max, n_unmasked_min, n_unmasked_max)`` for query tile ``m_block``.

    KV blocks ``n_block_min .. n_block_max - 1`` hold every key visible to some row of the tile
    below ``seqlen_q``, and no block past the last one holding a key below ``seqlen_k`` (an empty
    range when the tile has no such row or sees nothing, e.g. causal with
    ``seqlen_q > seqlen_k``); blocks in ``[n_unmasked_min, n_unmasked_max)`` lie below
    ``seqlen_k`` and inside the band of every row of the tile, so they need no mask. Without a
    window ``n_block_min`` and ``n_unmasked_min`` are the constant 0.
    """
    offset = seqlen_k - seqlen_q
    first_row = m_block * tile_m
    n_block_min, n_unmasked_min = 0, 0
    n_block_max = (seqlen_k + tile_n - 1) // tile_n
    n_unmasked_max = seqlen_k // tile_n
    right = _right_bound(causal, window_right)
    if right is not None:
        # The tile's last row sees keys j < first_row + tile_m + offset + right, its first row
        # keys j < first_row + 1 + offset + right.
        last_end = first_row + tile_m + offset + right
        n_block_max = cutlass.min(n_block_max, (cutlass.max(last_end, 0) + tile_n - 1) // tile_n)
        first_end = first_row + 1 + offset + right
        n_unmasked_max = cutlass.min(n_unmasked_max, cutlass.max(first_end, 0) // tile_n)
    if window_left is not None:
        # The first row sees keys j >= first_row + offset - left, the last row keys
        # j >= first_row + tile_m - 1 + offset - left.
        n_block_min = cutlass.max(first_row + offset - window_left, 0) // tile_n
        last_start = cutlass.max(first_row + tile_m - 1 + offset - window_left, 0)
        n_unmasked_min = (last_start + tile_n - 1) // tile_n
    has_rows = cutlass.min(cutlass.max(seqlen_q - first_row, 0), 1)  # 0 past seqlen_q (varlen)
    n_block_max = cutlass.max(n_block_max * has_rows, n_block_min)
    return n_block_min, n_block_max, n_unmasked_min, n_unmasked_max


def block_needs_mask(
    n_block: Int32, n_unmasked_min: Int32, n_unmasked_max: Int32, windowed: bool
) -> cutlass.Boolean:
    """Whether KV block ``n_block`` needs :func:`apply_mask`: it lies outside
    :func:`kv_block_range`'s unmasked blocks (whose lower end exists only with a window)."""
    needs = n_block >= n_unmasked_max
    if windowed:
        needs = needs | (n_block < n_unmasked_min)
    return needs


def split_by_mask(
    lo: Int32, hi: Int32, n_unmasked_min: Int32, n_unmasked_max: Int32, windowed: bool
) -> tuple[Int32, Int32]:
    """``(mid_lo, top_lo)`` with ``lo <= mid_lo <= top_lo <= hi`` (given ``lo <= hi``): of the
    KV blocks ``lo .. hi - 1``, those in ``[mid_lo, top_lo)`` need no mask
    (:func:`block_needs_mask` is false for each), the others are masked: ``[top_lo, hi)``
    (diagonal, ``seqlen_k`` residue, right window edge) and ``[lo, mid_lo)`` (left window
    edge; empty without a window). A kernel that wants no branch on the mask inside its loop
    runs three loops over these ranges, the mask a compile-time choice in each."""
    top_lo = cutlass.max(lo, cutlass.min(n_unmasked_max, hi))
    mid_lo = lo
    if windowed:
        mid_lo = cutlass.max(lo, cutlass.min(n_unmasked_min, top_lo))
    return mid_lo, top_lo


def padded_key_rows(
    n_block: Int32, seqlen_k: Int32, extent_k: Int32, tile_n: int
) -> tuple[Int32, Int32]:
    """``(start, end)``: rows ``start .. end - 1`` of KV block ``n_block`` (counted inside the
    block) lie past the valid ``seqlen_k`` but inside the tensor's ``extent_k`` rows, so a TMA
    load brings whatever the padding holds (NaN under the harness); rows past ``extent_k`` arrive
    as zeros. Empty when ``end <= start``."""
    return seqlen_k - n_block * tile_n, cutlass.min(extent_k - n_block * tile_n, tile_n)


def key_range(
    row: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: bool,
    window_left: Int32 | None = None,
    window_right: Int32 | None = None,
) -> tuple[Int32, Int32]:
    """Query row ``row`` sees exactly the keys ``start <= j < limit`` (empty when
    ``limit <= start``); ``start`` is the constant 0 without a window."""
    limit = seqlen_k
    right = _right_bound(causal, window_right)
    if right is not None:
        limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q + right)
    start = 0
    if window_left is not None:
        start = row + seqlen_k - seqlen_q - window_left
    return start, limit


@cute.jit
def apply_mask(
    scores: cute.Tensor,
    coords: cute.Tensor,
    row_offset: Int32,
    col_offset: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    window_left: Int32 | None = None,
    window_right: Int32 | None = None,
) -> None:
    """Set invisible scores to ``-inf`` in place.

    ``scores`` and ``coords`` are ``(rows, cols)`` views of one thread's fragment; the absolute
    position of element ``(r, c)`` is ``(row_offset, col_offset) + coords[r, c]``.
    """
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        row = row_offset + coords[r, 0][0]
        start, limit = key_range(row, seqlen_q, seqlen_k, causal, window_left, window_right)
        col_start, col_limit = start - col_offset, limit - col_offset
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            # Conditional expressions (selects), not ``if`` statements: a chain of branches
            # on comparisons with consecutive constants became a quadratic cascade of selects
            # (the masked loop's 996 FSEL for 64 scores per thread at 128 x 128 became 66:
            # scripts/sm90_sass.py).
            col = coords[r, c][1]
            hidden = col >= col_limit
            if cutlass.const_expr(window_left is not None):
                hidden = hidden | (col < col_start)
            scores[r, c] = -cutlass.Float32.inf if hidden else scores[r, c]
