"""Paged KV: the layout a paged-KV kernel reads, built from a case's logical K/V.

The case model keeps logical ``k [B, Sk, Hkv, D]`` / ``v [B, Sk, Hkv, Dv]``. A paged kernel
(flash_attn.cute's ``page_table``) instead gets physical pages ``[num_pages, page_size, Hkv,
D]`` and a table ``[B, max_pages]``: logical key ``j`` of batch ``b`` lives at slot ``j %
page_size`` of page ``page_table[b, j // page_size]``. :func:`page_kv` builds that layout the
way that catches lookup bugs: pages in shuffled order, identical full pages shared between
sequences (legal: a common prefix), and everything no sequence may read poisoned with the
case's ``page_fill``, NaN by default (the tail of a partly filled last page, unused pages, and
table entries past a sequence's pages, which point at a poisoned page). :func:`read_pages` is
the lookup and :func:`paged_attention` runs the streaming tier through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import FLOAT64_PRECISION, streaming_attention


@dataclass(frozen=True, eq=False)
class PagedKV:
    """Physical K/V pages, the page table and the valid key length of each sequence."""

    k_pages: np.ndarray  # [num_pages, page_size, Hkv, D]
    v_pages: np.ndarray  # [num_pages, page_size, Hkv, Dv]
    page_table: np.ndarray  # int32 [B, max_pages]
    k_lengths: tuple[int, ...]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def shared_pages(self) -> int:
        """Physical pages that more than one sequence reads."""
        used = [
            set(self.page_table[b, : -(-n // self.page_size)].tolist())
            for b, n in enumerate(self.k_lengths)
        ]
        counts = np.bincount([p for pages in used for p in pages], minlength=len(self.k_pages))
        return int((counts > 1).sum())


def page_kv(case: AttentionCase, page_size: int, *, seed: int = 0, extra_pages: int = 1) -> PagedKV:
    """The paged layout of ``case``'s valid keys (module docstring); ``seed`` shuffles the
    pages; ``extra_pages`` >= 1 unused pages. Slots no sequence may read hold
    ``case.page_fill``."""
    for name, value, low in (("page_size", page_size, 1), ("extra_pages", extra_pages, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    lengths = tuple(case.k_length(b) for b in range(case.B))
    max_pages = max(1, -(-case.Sk // page_size))
    logical = []  # (b, page index) of every page some sequence needs, unshared
    owner: dict[bytes, int] = {}  # content of a full page -> its first logical page
    alias: dict[tuple[int, int], int] = {}
    for b, n in enumerate(lengths):
        for p in range(-(-n // page_size)):
            rows = slice(p * page_size, (p + 1) * page_size)
            if (p + 1) * page_size <= n:  # a full page: shareable when its content repeats
                key = case.k[b, rows].tobytes() + case.v[b, rows].tobytes()
                if key in owner:
                    alias[(b, p)] = owner[key]
                    continue
                owner[key] = len(logical)
            alias[(b, p)] = len(logical)
            logical.append((b, p))
    num_pages = len(logical) + extra_pages
    physical = np.random.default_rng(seed).permutation(num_pages)  # logical -> physical
    poison = int(physical[len(logical)])  # the first unused page
    k_pages = np.full((num_pages, page_size, case.Hkv, case.D), case.page_fill, np.float32)
    v_pages = np.full((num_pages, page_size, case.Hkv, case.Dv), case.page_fill, np.float32)
    for index, (b, p) in enumerate(logical):
        n = min(page_size, lengths[b] - p * page_size)  # a partly filled last page keeps the fill
        k_pages[physical[index], :n] = case.k[b, p * page_size : p * page_size + n]
        v_pages[physical[index], :n] = case.v[b, p * page_size : p * page_size + n]
    table = np.full((case.B, max_pages), poison, np.int32)
    for (b, p), index in alias.items():
        table[b, p] = physical[index]
    return PagedKV(k_pages.astype(case.k.dtype), v_pages.astype(case.v.dtype), table, lengths)


def read_pages(paged: PagedKV, b: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K and V of logical keys ``positions`` of sequence ``b``, through the page table."""
    pages = paged.page_table[b, positions // paged.page_size]  # page of key j: table[b, j // P]
    slots = positions % paged.page_size  # its slot in that page: j % P
    return paged.k_pages[pages, slots], paged.v_pages[pages, slots]


def paged_attention(
    case: AttentionCase,
    paged: PagedKV,
    precision: StreamingPrecision = FLOAT64_PRECISION,
    **streaming_options,
) -> AttentionResult:
    """The streaming tier on K/V read through ``paged`` (keys past a sequence's length stay
    NaN: padding, never read); ``case`` supplies q, the scale, the mask and the options."""
    if paged.k_lengths != tuple(case.k_length(b) for b in range(case.B)):
        raise ValueError(f"paged.k_lengths={list(paged.k_lengths)} must be the case's key lengths")
    k = np.full(case.k.shape, np.nan, np.float32).astype(case.k.dtype)
    v = np.full(case.v.shape, np.nan, np.float32).astype(case.v.dtype)
    for b, n in enumerate(paged.k_lengths):
        k[b, :n], v[b, :n] = read_pages(paged, b, np.arange(n))
    with np.errstate(invalid="ignore"):
        through_pages = dataclasses.replace(case, k=k, v=v)
    return streaming_attention(through_pages, precision, **streaming_options)
