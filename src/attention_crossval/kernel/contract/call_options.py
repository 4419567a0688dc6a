"""How an adapter hands a kernel a case's call options, once for every adapter.

A case keeps logical, padded q, k, v; its call options (``case.page_size``, ``case.num_splits``,
``case.layout``) say how the kernel is called. Every adapter builds the layouts here, so every
kernel is handed the same ones:

* :func:`paged_layout`: the pages and page table of :func:`reference.paged.page_kv` (shuffled,
  shared and NaN-poisoned pages), with a seed taken from the case's description, so the two runs
  of a case see the same layout (the determinism check compares them bitwise);
* :func:`packed_layout`: the concatenated valid rows and ``cu_seqlens`` of
  :func:`reference.varlen.pack`; a kernel's packed ``o`` / ``lse`` come back through
  :func:`reference.varlen.unpack_result`;
* :func:`per_sequence`: for a CPU kernel written per sequence, each sequence's q, k, v read
  *through* those layouts (the page table, the offsets) as a one-sequence case, and the results
  written back through the same layout, so an offset or lookup bug shows in the result.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.paged import PagedKV, page_kv, read_pages
from attention_crossval.reference.varlen import PackedVarlen, pack, unpack_result

__all__ = ["layout_seed", "packed_layout", "paged_layout", "per_sequence", "unpack_result"]


def layout_seed(case: AttentionCase) -> int:
    """A seed from the case's description: the same for the NaN-padded and clean copies."""
    return zlib.crc32(case.describe().encode())


def paged_layout(case: AttentionCase) -> PagedKV | None:
    """The paged K/V of a case with ``page_size`` (None without)."""
    if case.page_size is None:
        return None
    return page_kv(case, case.page_size, seed=layout_seed(case))


def packed_layout(case: AttentionCase) -> PackedVarlen | None:
    """The packed q, k, v and offsets of a ``layout="packed"`` case (None when padded)."""
    return pack(case) if case.layout == "packed" else None


def _sequence_mask(case: AttentionCase, b: int, q_len: int, k_len: int) -> Mask:
    """Sequence ``b``'s mask as a one-sequence case of ``q_len`` x ``k_len`` sees it: causal
    and window diagonals sit at the valid lengths in either alignment, so they carry over."""
    mask, explicit = case.mask, case.mask.explicit
    if explicit is not None:
        explicit = explicit[b if explicit.shape[0] > 1 else 0][None, :, :q_len, :k_len]
    return Mask(
        causal=mask.causal,
        window_left=mask.window_left,
        window_right=mask.window_right,
        alignment=mask.alignment,
        explicit=explicit,
    )


def per_sequence(
    case: AttentionCase,
    attend: Callable[[AttentionCase], AttentionResult],
    *,
    packed: PackedVarlen | None,
    paged: PagedKV | None,
) -> AttentionResult:
    """``attend`` on each sequence of ``case``, its q read from ``packed`` (else the padded
    rows), its K/V through ``paged`` (else ``packed``, else the padded rows); the outputs
    written packed and unpacked when ``packed``. Rows of a sequence without keys stay empty."""
    q_lengths = [case.q_length(b) for b in range(case.B)]
    k_lengths = [case.k_length(b) for b in range(case.B)]
    empty = -np.inf if case.sink is None else case.sink.astype(np.float64)[:, None]
    if packed is not None:
        cu_q, cu_k = packed.cu_seqlens_q, packed.cu_seqlens_k
        o = np.zeros((int(cu_q[-1]), case.Hq, case.Dv))
        lse = np.broadcast_to(empty, (case.Hq, int(cu_q[-1]))).copy()
    else:
        o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
        lse = np.broadcast_to(empty, (case.B, case.Hq, case.Sq)).copy()
    for b, (q_len, k_len) in enumerate(zip(q_lengths, k_lengths, strict=True)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1])) if packed is not None else slice(0, q_len)
        lse_rows = lse[:, rows] if packed is not None else lse[b, :, rows]
        if q_len == 0 or k_len == 0:
            continue
        q = packed.q[rows] if packed is not None else case.q[b, :q_len]
        if paged is not None:
            k, v = read_pages(paged, b, np.arange(k_len))
        elif packed is not None:
            keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
            k, v = packed.k[keys], packed.v[keys]
        else:
            k, v = case.k[b, :k_len], case.v[b, :k_len]
        sequence = AttentionCase(
            q[None],
            k[None],
            v[None],
            case.softmax_scale,
            _sequence_mask(case, b, q_len, k_len),
            case.label,
            softcap=case.softcap,
            sink=case.sink,
        )
        result = attend(sequence)
        if packed is not None:
            o[rows] = result.o[0]
        else:
            o[b, rows] = result.o[0]
        lse_rows[:] = result.lse[0]
    if packed is not None:
        return unpack_result(case, o, lse)
    return AttentionResult(o=o, lse=lse)
