"""CPU kernels, each with one deliberate bug in one call option, to show the suite catches it.

Each is the ``streaming-fa`` adapter (:class:`kernel.adapters.streaming.StreamingAdapter`) with
one part swapped, and declares exactly what ``streaming-fa`` declares:

* ``page_lookup_off_by_one``: reads key j of sequence b from page table entry ``j // P + 1``
  (one entry late): wrong keys, and the NaN-poisoned page past a sequence's pages (the
  streaming tier refuses NaN at a visible key: an ``error`` in its worker);
* ``empty_split_lse_zero``: the combine reads an empty split's partial LSE of -inf as 0, so
  that split's zero output gets weight in the average (more splits than K blocks);
* ``packed_offset_overrun``: reads each sequence's keys from ``cu_seqlens_k[b] + 1`` on, one row
  late: the last key of sequence b reads the first of sequence b + 1.

``EXPECTED`` names the checks each one fails (``properties/test_call_options.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.paged import PagedKV
from attention_crossval.reference.splitkv import combine
from attention_crossval.reference.varlen import PackedVarlen

# Wrong values fail the bound; a read of a NaN-poisoned page is an error.
EXPECTED = {
    "page_lookup_off_by_one": frozenset({"bound", "lse", "error"}),
    "empty_split_lse_zero": frozenset({"bound", "lse"}),
    "packed_offset_overrun": frozenset({"bound", "lse"}),
}


def _named(name: str) -> dict:
    spec = StreamingAdapter().spec
    return {"spec": dataclasses.replace(spec, name=f"broken-{name.replace('_', '-')}")}


class _PageLookupOffByOne(StreamingAdapter):
    def layouts(self, case: AttentionCase) -> tuple[PackedVarlen | None, PagedKV | None]:
        packed, paged = super().layouts(case)
        if paged is None:
            return packed, paged
        late = np.array(paged.page_table)
        late[:, :-1] = paged.page_table[:, 1:]  # entry p holds entry p + 1
        return packed, dataclasses.replace(paged, page_table=late)


class _PackedOffsetOverrun(StreamingAdapter):
    def layouts(self, case: AttentionCase) -> tuple[PackedVarlen | None, PagedKV | None]:
        packed, paged = super().layouts(case)
        if packed is None:
            return packed, paged
        late = packed.cu_seqlens_k + np.int32(1)
        late[0] = 1
        return dataclasses.replace(packed, cu_seqlens_k=late), paged


def _lse_zero_combine(o_parts: np.ndarray, lse_parts: np.ndarray, dtype: np.dtype) -> tuple:
    return combine(o_parts, np.where(lse_parts == -np.inf, 0.0, lse_parts), dtype)


def page_lookup_off_by_one() -> StreamingAdapter:
    return _PageLookupOffByOne(**_named("page_lookup_off_by_one"))


def empty_split_lse_zero() -> StreamingAdapter:
    return StreamingAdapter(**_named("empty_split_lse_zero"), combine=_lse_zero_combine)


def packed_offset_overrun() -> StreamingAdapter:
    return _PackedOffsetOverrun(**_named("packed_offset_overrun"))
