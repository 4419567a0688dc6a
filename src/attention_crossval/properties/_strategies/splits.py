"""Split-KV plans: how many splits a split-KV kernel runs a case with.

``num_splits`` is a call option (``AttentionCase.num_splits``): :func:`splitkv_cases` draws it
next to each case, sets it and records it in the label (``num_splits=<n>``). Choices cluster
where split-KV breaks: one split (the plain loop), one split per K block or one fewer
(boundaries on every tile edge; the base strategy's lengths sit at ``k * tile +- 1``, so just
off them too), more splits than blocks (trailing splits see no key: partial LSE = -inf), and
in the default strategy (:func:`draw_num_splits`) counts that divide a sequence's blocks evenly.
"""

from __future__ import annotations

import dataclasses

from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.reference.case import AttentionCase


def num_splits_of(case: AttentionCase) -> int:
    """The case's ``num_splits`` (1 when it has no split)."""
    return case.num_splits


def split_choices(case: AttentionCase, tile_n: int, max_splits: int) -> list[int]:
    """Sorted split counts in ``[1, max_splits]`` where split-KV breaks (module docstring)."""
    blocks = -(-max(case.k_length(b) for b in range(case.B)) // tile_n)
    choices = {1, 2, blocks - 1, blocks, blocks + 1, 2 * blocks + 1}
    return sorted(n for n in choices if 1 <= n <= max_splits)


def draw_num_splits(draw: st.DrawFn, case: AttentionCase, tile_n: int, max_splits: int) -> int:
    """A count above 1: three times in four (and shrinking to it) one that divides a sequence's
    K block count evenly with a block or more per split (the last split's chunk then ends the
    row exactly: a remainder of 0 must not mean an empty chunk), when there is one; else one of
    :func:`split_choices` (more splits than blocks among them)."""
    choices = [n for n in split_choices(case, tile_n, max_splits) if n > 1]
    blocks = {-(-case.k_length(b) // tile_n) for b in range(case.B)}
    even = [n for n in range(2, max_splits + 1) if any(k >= n and k % n == 0 for k in blocks)]
    if even and draw(st.integers(0, 7)) < 7:
        return draw(st.sampled_from(even))
    return draw(st.sampled_from(choices))


def with_splits(case: AttentionCase, num_splits: int, tile_n: int) -> AttentionCase:
    """``case`` with ``num_splits`` set and in its label."""
    blocks = -(-max(case.k_length(b) for b in range(case.B)) // tile_n)
    event(f"num_splits vs K blocks: {'more' if num_splits > blocks else 'at most'}")
    label = f"{case.label} num_splits={num_splits}".strip()
    return dataclasses.replace(case, num_splits=num_splits, label=label)


@st.composite
def _splitkv_cases(
    draw: st.DrawFn, base: st.SearchStrategy[AttentionCase], tile_n: int, max_splits: int
) -> AttentionCase:
    case = draw(base)
    num_splits = draw(st.sampled_from(split_choices(case, tile_n, max_splits)))
    return with_splits(case, num_splits, tile_n)


def splitkv_cases(
    base: st.SearchStrategy[AttentionCase], *, tile_n: int, max_splits: int = 8
) -> st.SearchStrategy[AttentionCase]:
    """Cases of ``base`` with a drawn ``num_splits`` in ``[1, max_splits]`` for a kernel whose
    K block is ``tile_n``."""
    for name, value in (("tile_n", tile_n), ("max_splits", max_splits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    return _splitkv_cases(base, tile_n, max_splits)
