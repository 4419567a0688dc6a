"""The key order of V that the SM90 kernel's FP8 ``P V`` WGMMA needs, for the launcher.

FP8 WGMMA reads both shared-memory operands K-major, so V goes to the kernel transposed (keys
contiguous, ``[B, Hkv, D, S]`` viewed as ``[B, S, Hkv, D]``). And P's register A fragment holds
different keys per lane than the S accumulator it is converted from
(kernel/own/sm90/fwd.py: ``fp8_p_layouts``): the kernel keeps every value in its lane and
relabels keys instead, so position ``j`` of each 32-key block of V must hold key
``fp8_key_order(...)[j]``. A product of P and V summed over the keys is the same in any key order
as long as both use it; only the summation order inside the tensor core changes.

Pure NumPy (no cutlass, no torch): the CPU tests check it against the MMA layouts, and the
launcher applies it with a gather.
"""

from __future__ import annotations

import numpy as np

KEYS_PER_BLOCK = 32  # the k extent of an FP8 WGMMA: the order repeats every 32 keys


def fp8_key_order(num_keys: int) -> np.ndarray:
    """``order[j]``: the key V position ``j`` holds, for ``num_keys`` a multiple of 32.

    Inside a 32-key block, lane ``t`` of a quad holds S's key pairs ``2t, 2t+1`` of each 8-key
    group ``g``; the A fragment reads 4 keys per half ``h``: ``16h + 4t + i`` for ``i < 4``, fed
    from S's groups ``2h`` (``i < 2``) and ``2h + 1`` (``i >= 2``): key
    ``16h + 8(i // 2) + 2t + i % 2``.

    >>> fp8_key_order(32)[:8].tolist()
    [0, 1, 8, 9, 2, 3, 10, 11]
    """
    if not isinstance(num_keys, int) or num_keys < 0 or num_keys % KEYS_PER_BLOCK:
        raise ValueError(f"num_keys={num_keys!r} must be a non-negative multiple of 32")
    j = np.arange(num_keys)
    q = j % KEYS_PER_BLOCK
    half, lane, i = q // 16, (q % 16) // 4, q % 4
    return j - q + 16 * half + 8 * (i // 2) + 2 * lane + i % 2


def padded_keys(num_keys: int) -> int:
    """The key extent of the reordered V: ``num_keys`` rounded up to a multiple of 32 (keys past
    ``num_keys`` are zeros, weighted by ``P = 0``; also 16-byte row strides for its TMA)."""
    return -(-num_keys // KEYS_PER_BLOCK) * KEYS_PER_BLOCK
