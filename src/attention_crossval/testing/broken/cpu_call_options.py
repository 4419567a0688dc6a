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

``EXPECTED`` names the checks each one fails (``tests/kernel/test_call_options.py``).

Two more mirror flash-attn-cute's paged read on the H200 (pages as large as its K tile): they
read the whole last page of each sequence and weight its unused tail by 0, so NaN there reaches
every row of the sequence. Both declare it as a known ``padding-read`` of paged cases
(:data:`READS_PAGE_TAIL`), to show the harness classifies it and the known finding covers it
(``tests/kernel/test_known_findings.py``):

* ``reads_page_tail``: that read and nothing else;
* ``reads_page_tail_and_wrong``: that read, and O scaled by 1 + 2^-4 on paged cases, a bug the
  known finding must not hide.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.paged import PagedKV
from attention_crossval.reference.splitkv import combine
from attention_crossval.reference.varlen import PackedVarlen

# Wrong values fail the bound; a read of a NaN-poisoned page is an error.
EXPECTED = {
    "page_lookup_off_by_one": frozenset({"bound", "lse", "error"}),
    "empty_split_lse_zero": frozenset({"bound", "lse"}),
    "packed_offset_overrun": frozenset({"bound", "lse"}),
}


READS_PAGE_TAIL = KnownFinding(
    check="padding-read",
    mask_kinds=frozenset(),
    features=frozenset({"paged"}),
    reason="it reads each sequence's last page whole and weights the unused tail by 0, so NaN "
    "there reaches the sequence's rows (deliberate, for tests)",
    link="https://example.com/upstream-issue",  # a placeholder: the finding is made up
)


def _named(name: str, *known: KnownFinding) -> dict:
    spec = StreamingAdapter().spec
    name = f"broken-{name.replace('_', '-')}"
    return {"spec": dataclasses.replace(spec, name=name, known_findings=known)}


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


@dataclass
class _ReadsPageTail(StreamingAdapter):
    wrong: bool = False

    def __call__(self, case: AttentionCase) -> AttentionResult:
        result = super().__call__(case)
        _, paged = self.layouts(case)
        if paged is None:
            return result
        o = np.array(result.o)
        for b, n in enumerate(paged.k_lengths):
            if n % paged.page_size:  # a partly filled last page: its tail weighted by 0
                tail = paged.v_pages[paged.page_table[b, (n - 1) // paged.page_size]]
                o[b] += 0.0 * tail[n % paged.page_size :].astype(np.float64).sum()
        return AttentionResult(o=o * (1 + 2.0**-4) if self.wrong else o, lse=result.lse)


def _lse_zero_combine(o_parts: np.ndarray, lse_parts: np.ndarray, dtype: np.dtype) -> tuple:
    return combine(o_parts, np.where(lse_parts == -np.inf, 0.0, lse_parts), dtype)


def page_lookup_off_by_one() -> StreamingAdapter:
    return _PageLookupOffByOne(**_named("page_lookup_off_by_one"))


def empty_split_lse_zero() -> StreamingAdapter:
    return StreamingAdapter(**_named("empty_split_lse_zero"), combine=_lse_zero_combine)


def packed_offset_overrun() -> StreamingAdapter:
    return _PackedOffsetOverrun(**_named("packed_offset_overrun"))


def reads_page_tail() -> StreamingAdapter:
    return _ReadsPageTail(**_named("reads_page_tail", READS_PAGE_TAIL))


def reads_page_tail_and_wrong() -> StreamingAdapter:
    return _ReadsPageTail(**_named("reads_page_tail_and_wrong", READS_PAGE_TAIL), wrong=True)
