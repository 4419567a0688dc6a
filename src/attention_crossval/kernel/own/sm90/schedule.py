"""Which query tile each CTA of the SM90 kernel computes, and which KV blocks that tile visits.

The one-tile grid maps ``blockIdx.x`` to a query tile (:func:`tile_for_block`); the persistent
grid walks linear tiles ``blockIdx.x, blockIdx.x + gridDim.x, ...`` and decodes each
(:func:`persistent_tile`). Either way :func:`tile_work` gives the tile's lengths and block
range, the one rule the producer warp and the consumer warpgroups both follow, so the producer's
sequence of stage fills is exactly the consumers' sequence of waits.

The order helpers are plain arithmetic on non-negative values, so the CPU tests replay them on
Python ints.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from attention_crossval.kernel.own.common.mask import kv_block_range
from attention_crossval.kernel.own.common.params import Tile

# persistent + longest-first: the (batch, head) pairs are walked in sections whose K and V fit
# together in about this many bytes of L2 (FlashAttention's LPT swizzle), so that the CTAs
# working at the same time on the long tiles of a section share their K/V through L2.
LPT_L2_BYTES = 40 * 1024 * 1024


class Limits(NamedTuple):
    """The launch's optional bounds on which keys each query sees: the per-batch valid lengths
    (int32 ``[B]``, both or neither) and the window ``(left, right)`` (both or neither)."""

    seqused_q: cute.Tensor | None
    seqused_k: cute.Tensor | None
    window: tuple[Int32 | None, Int32 | None]


class PersistentGrid(NamedTuple):
    """What every role of a persistent CTA needs to decode its linear tiles
    (:func:`persistent_tile`): ``num_hb = num_heads * batches``, ``num_tiles = num_m_blocks *
    num_hb``, and the longest-first choice with its section size."""

    num_m_blocks: Int32
    num_heads: Int32
    num_hb: Int32
    num_tiles: Int32
    section: Int32
    longest_first: bool


def tile_for_block(block_x: Int32, num_m_blocks: Int32, longest_first: bool) -> Int32:
    """The query tile (m_block) CTA ``block_x`` of ``num_m_blocks`` computes: itself, or with
    ``longest_first`` the reversed order, so the tiles with the most KV blocks under a causal
    mask (the last ones) are launched first and the short ones fill the tail of the grid
    (FlashAttention's LPT order, without its L2 swizzle of heads). A permutation of
    ``range(num_m_blocks)``."""
    return num_m_blocks - 1 - block_x if longest_first else block_x


def key_extent(mK: cute.Tensor, seqused_k: cute.Tensor | None) -> Int32 | None:
    """The K/V rows when V rows past ``seqused_k`` must be zeroed (varlen), else None."""
    return None if seqused_k is None else mK.shape[0]


def lpt_section(seqlen_k: Int32, head_dim: int, elem_bytes: int) -> Int32:
    """How many (batch, head) pairs one longest-first section holds: as many as have their K
    and V (``seqlen_k`` rows of ``2 * head_dim`` elements) in :data:`LPT_L2_BYTES`, at least 1.
    The constant is divided first, so nothing overflows int32."""
    return cutlass.max(LPT_L2_BYTES // (2 * head_dim * elem_bytes) // cutlass.max(seqlen_k, 1), 1)


def persistent_grid(
    mQ: cute.Tensor,
    mK: cute.Tensor,
    tile_m: int,
    head_dim: int,
    elem_bytes: int,
    longest_first: bool,
) -> PersistentGrid:
    """The persistent walk over ``mQ``'s query tiles (``(s, d, h, b)`` views as
    kernel/own/common/host.py makes them): longest-first sections sized by :func:`lpt_section`
    when ``longest_first``, else one section of every (batch, head) pair."""
    num_m_blocks = (mQ.shape[0] + tile_m - 1) // tile_m
    num_heads = mQ.shape[2]
    num_hb = num_heads * mQ.shape[3]
    num_tiles = num_m_blocks * num_hb
    section = num_hb
    if longest_first:
        section = lpt_section(mK.shape[0], head_dim, elem_bytes)
    return PersistentGrid(num_m_blocks, num_heads, num_hb, num_tiles, section, longest_first)


def persistent_tile(
    tile: Int32,
    num_m_blocks: Int32,
    num_heads: Int32,
    num_hb: Int32,
    section: Int32,
    longest_first: bool,
) -> tuple[Int32, Int32, Int32]:
    """``(m_block, head, batch)`` of linear tile ``tile`` (``0 <= tile < num_m_blocks *
    num_hb``, ``num_hb = num_heads * batches``) of the persistent kernel, a bijection:

    * without ``longest_first``: ``m_block`` fastest, then head, then batch (the order of the
      non-persistent grid: consecutive tiles share their K/V);
    * with it: sections of ``section`` consecutive (batch, head) pairs (the last one may be
      shorter), one after the other; inside a section ``m_block`` descending (the tiles with
      the most causal KV blocks first), the pair fastest."""
    if longest_first:
        section_tiles = section * num_m_blocks
        first_hb = tile // section_tiles * section
        rest = tile - first_hb * num_m_blocks
        size = cutlass.min(section, num_hb - first_hb)
        m_idx = rest // size
        hb = first_hb + (rest - m_idx * size)
        m_block = num_m_blocks - 1 - m_idx
    else:
        hb = tile // num_m_blocks
        m_block = tile - hb * num_m_blocks
    batch = hb // num_heads
    return m_block, hb - batch * num_heads, batch


@cute.jit
def tile_work(
    m_block: Int32,
    head: Int32,
    batch: Int32,
    mQ: cute.Tensor,
    mK: cute.Tensor,
    limits: Limits,
    tile_shape: tuple[int, int],
    causal: bool,
) -> Tile:
    """Query tile ``m_block`` of ``(head, batch)`` of ``tile_shape = (tile_m, tile_n)``: the
    tensors' lengths, or the batch's ``seqused_q/k``, :func:`kv_block_range`'s answer, and the
    limits' key bounds (:func:`key_extent`, the window)."""
    seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
    if cutlass.const_expr(limits.seqused_q is not None):
        seqlen_q, seqlen_k = limits.seqused_q[batch], limits.seqused_k[batch]
    blocks = kv_block_range(m_block, seqlen_q, seqlen_k, *tile_shape, causal, *limits.window)
    extent_k = key_extent(mK, limits.seqused_k)
    return Tile(m_block, head, batch, seqlen_q, seqlen_k, blocks, extent_k, limits.window)
