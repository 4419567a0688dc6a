"""Split-KV plans: how many splits a split-KV kernel runs a case with.

``num_splits`` is a kernel parameter, not part of the case: :func:`splitkv_cases` draws it next
to each case and records it in the label (``num_splits=<n>``, read back by
:func:`num_splits_of`). Choices cluster where split-KV breaks: one split (the plain loop), one
split per K block or one fewer (boundaries on every tile edge; the base strategy's lengths sit
at ``k * tile +- 1``, so just off them too), and more splits than blocks (trailing splits see no
key: partial LSE = -inf).
"""

from __future__ import annotations

import dataclasses

from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.reference.case import AttentionCase


def num_splits_of(case: AttentionCase) -> int:
    """The ``num_splits=<n>`` of a :func:`splitkv_cases` label (1 when there is none)."""
    for part in case.label.split():
        key, _, value = part.partition("=")
        if key == "num_splits":
            return int(value)
    return 1


@st.composite
def _splitkv_cases(
    draw: st.DrawFn, base: st.SearchStrategy[AttentionCase], tile_n: int, max_splits: int
) -> AttentionCase:
    case = draw(base)
    blocks = -(-max(case.k_length(b) for b in range(case.B)) // tile_n)
    choices = {1, 2, blocks - 1, blocks, blocks + 1, 2 * blocks + 1}
    num_splits = draw(st.sampled_from(sorted(n for n in choices if 1 <= n <= max_splits)))
    event(f"num_splits vs K blocks: {'more' if num_splits > blocks else 'at most'}")
    return dataclasses.replace(case, label=f"{case.label} num_splits={num_splits}".strip())


def splitkv_cases(
    base: st.SearchStrategy[AttentionCase], *, tile_n: int, max_splits: int = 8
) -> st.SearchStrategy[AttentionCase]:
    """Cases of ``base`` labelled with a drawn ``num_splits`` in ``[1, max_splits]`` for a
    kernel whose K block is ``tile_n``."""
    for name, value in (("tile_n", tile_n), ("max_splits", max_splits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    return _splitkv_cases(base, tile_n, max_splits)
