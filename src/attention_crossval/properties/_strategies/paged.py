"""Paged-KV layouts for drawn cases: page sizes that do not divide the kernel's tile, partly
filled last pages, zero-length sequences (from the base strategy's varlen masks), sequences
that share a prefix, so their full pages are shared in the page table, and (mostly) page sizes
that every sequence fills to its last slot, preferring those whose last page a query sees."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.masks import visible_all
from attention_crossval.reference.paged import PagedKV, page_kv


def _share_prefix(case: AttentionCase, page_size: int) -> AttentionCase:
    """Batch 1 takes batch 0's K/V on their common whole pages (a legal page to share)."""
    n = min(case.k_length(0), case.k_length(1)) // page_size * page_size
    k, v = np.array(case.k), np.array(case.v)
    k[1, :n], v[1, :n] = k[0, :n], v[0, :n]
    return dataclasses.replace(case, k=k, v=v)


def page_sizes(tile_n: int) -> list[int]:
    """Sorted page sizes around the kernel's K block: most do not divide it."""
    return sorted({1, 3, tile_n // 2 + 1, tile_n - 1, tile_n, tile_n + 1, 2 * tile_n + 1} - {0})


def filling_page_sizes(case: AttentionCase) -> list[int]:
    """Page sizes that divide every non-empty sequence's key count, below the longest one: each
    sequence fills its last page to the last slot, and the longest fills its table row over
    two pages or more (a lookup of the last page one entry late leaves the row)."""
    lengths = [case.k_length(b) for b in range(case.B)]
    common = math.gcd(*lengths)
    return [p for p in range(1, common + 1) if common % p == 0 and p < max(lengths)]


def seen_last_pages(case: AttentionCase, sizes: list[int]) -> list[int]:
    """The page sizes of ``sizes`` for which some query sees a key on some sequence's last
    page: a lookup of that page one entry late changes the output only there (a window, a
    causal diagonal or an explicit mask may hide every key of a one-key last page)."""
    seen = visible_all(case).any(axis=(1, 2))  # [B, Sk]: keys some query of the batch sees
    lengths = [case.k_length(b) for b in range(case.B)]
    return [
        p for p in sizes if any(n >= p and seen[b, n - p : n].any() for b, n in enumerate(lengths))
    ]


def with_pages(draw: st.DrawFn, case: AttentionCase, tile_n: int) -> AttentionCase:
    """``case`` with a drawn ``page_size`` (in its label): seven times in eight (and shrinking
    to it) one that every sequence fills (:func:`filling_page_sizes`, where one exists; those
    whose last page a query sees, :func:`seen_last_pages`, where any does), else one of
    :func:`page_sizes`; batches 0 and 1 sometimes share their common whole pages."""
    filling = filling_page_sizes(case)
    preferred = seen_last_pages(case, filling) or filling
    sizes = preferred if preferred and draw(st.integers(0, 7)) < 7 else page_sizes(tile_n)
    page_size = draw(st.sampled_from(sizes))
    if case.B >= 2 and draw(st.booleans()):
        case = _share_prefix(case, page_size)
    event(f"page_size vs tile: {'divides' if tile_n % page_size == 0 else 'does not divide'}")
    event(f"pages filled to the last slot: {'yes' if page_size in filling else 'no'}")
    label = f"{case.label} page_size={page_size}".strip()
    return dataclasses.replace(case, page_size=page_size, label=label)


@st.composite
def _paged_cases(
    draw: st.DrawFn, base: st.SearchStrategy[AttentionCase], tile_n: int
) -> tuple[AttentionCase, PagedKV]:
    case = with_pages(draw, draw(base), tile_n)
    paged = page_kv(case, case.page_size, seed=draw(st.integers(0, 2**32 - 1)))
    event(f"shared pages: {'yes' if paged.shared_pages else 'no'}")
    return case, paged


def paged_cases(
    base: st.SearchStrategy[AttentionCase], *, tile_n: int
) -> st.SearchStrategy[tuple[AttentionCase, PagedKV]]:
    """``(case, paged layout)`` pairs for a kernel whose K block is ``tile_n``."""
    if isinstance(tile_n, bool) or not isinstance(tile_n, int) or tile_n < 1:
        raise ValueError(f"tile_n={tile_n!r} must be an int >= 1")
    return _paged_cases(base, tile_n)
