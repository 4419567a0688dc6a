"""The one visibility predicate: which key each query row may see.

Both reference tiers and every adapter call :func:`visible`, so a mask convention is defined
in exactly one place (see ``Mask`` for the rules, :class:`CausalAlignment` for the diagonal).
The case model (reference/case.py) imports this module to let K/V hold anything where
:func:`hidden_keys` says no row looks; this module reads cases without importing that one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attention_crossval.reference.alignment import CausalAlignment

if TYPE_CHECKING:  # reference.case imports this module
    from attention_crossval.reference.case import AttentionCase


def visible(
    case: AttentionCase,
    b: int,
    h: int,
    rows: np.ndarray | slice = slice(None),
    cols: np.ndarray | slice = slice(None),
) -> np.ndarray:
    """Bool array ``[len(rows), len(cols)]``: True where query row i of (batch b, query head h)
    sees key j. ``rows`` / ``cols`` select absolute positions (a slice or an index array), so a
    streaming tile asks for exactly its block, partial last blocks included.
    """
    i = np.arange(case.Sq)[rows][:, None]
    j = np.arange(case.Sk)[cols][None, :]
    mask = case.mask
    q_len, k_len = case.q_length(b), case.k_length(b)
    seen = (i < q_len) & (j < k_len)
    offset, left, right = _band(case, b)
    if right is not None:
        seen &= j <= i + offset + right
    if left is not None:
        seen &= j >= i + offset - left
    if mask.explicit is not None:
        explicit = mask.explicit
        eb = b if explicit.shape[0] > 1 else 0
        eh = h if explicit.shape[1] > 1 else 0
        plane = np.broadcast_to(explicit[eb, eh], (case.Sq, case.Sk))
        seen &= plane[i, j]
    return seen


def _band(case: AttentionCase, b: int) -> tuple[int, int | None, int | None]:
    """``(offset, left, right)`` of batch b: key j is inside the causal/window band of row i iff
    ``i + offset - left <= j <= i + offset + right`` (None = unbounded on that side)."""
    mask = case.mask
    q_len, k_len = case.q_length(b), case.k_length(b)
    offset = k_len - q_len if mask.alignment is CausalAlignment.BOTTOM_RIGHT else 0
    right = mask.window_right
    if mask.causal:
        right = 0 if right is None else min(right, 0)
    return offset, mask.window_left, right


def visible_all(case: AttentionCase) -> np.ndarray:
    """Bool array ``[B, Hq, Sq, Sk]`` of :func:`visible` for every batch and query head."""
    return np.stack(
        [np.stack([visible(case, b, h) for h in range(case.Hq)]) for b in range(case.B)]
    )


def key_ranges(case: AttentionCase, b: int, rows: np.ndarray | slice = slice(None)):
    """``(lo, hi)`` int64 arrays over ``rows``: without an explicit mask, the keys query row i
    of batch b sees are exactly ``lo[i] <= j < hi[i]`` (one interval; ``lo == hi`` when
    empty), for every head. The same rule as :func:`visible`, in O(rows) instead of
    O(rows * Sk), so long cases never form a ``[Sq, Sk]`` array."""
    if case.mask.explicit is not None:
        raise ValueError("key_ranges: an explicit mask has no interval form (use visible)")
    i = np.arange(case.Sq, dtype=np.int64)[rows]
    q_len, k_len = case.q_length(b), case.k_length(b)
    offset, left, right = _band(case, b)
    hi = np.full(i.shape, k_len, np.int64)
    if right is not None:
        hi = np.minimum(hi, i + offset + right + 1)
    lo = np.zeros(i.shape, np.int64)
    if left is not None:
        lo = np.maximum(lo, i + offset - left)
    hi = np.where(i < q_len, np.maximum(hi, lo), lo)
    return lo, np.maximum(hi, lo)


def visible_counts(case: AttentionCase) -> np.ndarray:
    """Int ``[B, Hq, Sq]``: how many keys each row sees; O(B Hq Sq) without an explicit mask."""
    if case.mask.explicit is not None:
        return visible_all(case).sum(axis=-1)
    counts = np.empty((case.B, case.Hq, case.Sq), np.int64)
    for b in range(case.B):
        lo, hi = key_ranges(case, b)
        counts[b] = (hi - lo)[None, :]
    return counts


def empty_rows(case: AttentionCase) -> np.ndarray:
    """Bool array ``[B, Hq, Sq]``: rows that see no key (O = 0, LSE = -inf by convention)."""
    return visible_counts(case) == 0


def hidden_keys(case: AttentionCase) -> np.ndarray:
    """Bool ``[B, Sk, Hkv]``: keys that no query row of any head reading that kv head sees, by
    causal, window or explicit masks or padding. Their K/V may hold anything, NaN included: a
    kernel must not read them (or must not let what it read reach the output). Without an
    explicit mask, in O(Sq + Sk) per batch (the union of the rows' :func:`key_ranges`): a 64k
    prefill formed eight ``[Sq, Sk]`` planes here, 65 s on the H200's host."""
    seen = np.zeros((case.B, case.Sk, case.Hkv), dtype=bool)
    for b in range(case.B):
        if case.mask.explicit is None:
            seen[b] = _covered(*key_ranges(case, b), case.Sk)[:, None]
            continue
        for h in range(case.Hq):
            seen[b, :, case.kv_head(h)] |= visible(case, b, h).any(axis=0)
    return ~seen


def _covered(lo: np.ndarray, hi: np.ndarray, size: int) -> np.ndarray:
    """Bool ``[size]``: positions inside at least one interval ``lo <= j < hi <= size``."""
    nonempty = lo < hi  # an empty interval's lo may lie past size
    starts = np.zeros(size + 1, np.int64)
    np.add.at(starts, lo[nonempty], 1)
    np.add.at(starts, hi[nonempty], -1)
    return np.cumsum(starts[:size]) > 0
