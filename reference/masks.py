"""The one visibility predicate: which key each query row may see.

Both reference tiers and every adapter call :func:`visible`, so a mask convention is defined
in exactly one place (see ``Mask`` for the rules).
"""

from __future__ import annotations

import numpy as np

from attention_crossval.reference.case import AttentionCase, CausalAlignment


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
    offset = k_len - q_len if mask.alignment is CausalAlignment.BOTTOM_RIGHT else 0
    right = mask.window_right
    if mask.causal:
        right = 0 if right is None else min(right, 0)
    if right is not None:
        seen &= j <= i + offset + right
    if mask.window_left is not None:
        seen &= j >= i + offset - mask.window_left
    if mask.explicit is not None:
        explicit = mask.explicit
        eb = b if explicit.shape[0] > 1 else 0
        eh = h if explicit.shape[1] > 1 else 0
        plane = np.broadcast_to(explicit[eb, eh], (case.Sq, case.Sk))
        seen &= plane[i, j]
    return seen


def visible_all(case: AttentionCase) -> np.ndarray:
    """Bool array ``[B, Hq, Sq, Sk]`` of :func:`visible` for every batch and query head."""
    return np.stack(
        [np.stack([visible(case, b, h) for h in range(case.Hq)]) for b in range(case.B)]
    )


def empty_rows(case: AttentionCase) -> np.ndarray:
    """Bool array ``[B, Hq, Sq]``: rows that see no key (O = 0, LSE = -inf by convention)."""
    return ~visible_all(case).any(axis=-1)


def hidden_keys(case: AttentionCase) -> np.ndarray:
    """Bool ``[B, Sk, Hkv]``: keys that no query row of any head reading that kv head sees, by
    causal, window or explicit masks or padding. Their K/V may hold anything, NaN included: a
    kernel must not read them (or must not let what it read reach the output)."""
    seen = np.zeros((case.B, case.Sk, case.Hkv), dtype=bool)
    for b in range(case.B):
        for h in range(case.Hq):
            seen[b, :, case.kv_head(h)] |= visible(case, b, h).any(axis=0)
    return ~seen
