"""Packed varlen layout (``cu_seqlens``): sequences concatenated with no padding.

The case model is padded: ``q [B, Sq, Hq, D]`` with valid lengths ``mask.q_lengths`` (and
``k_lengths``). A packed-varlen kernel (flash_attn.cute's ``cu_seqlens_q/k``) takes
``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv, Dv]`` and cumulative offsets
``cu_seqlens [B + 1]`` (int32, ``cu[0] = 0``, ``cu[b + 1] - cu[b]`` = length of sequence b, zero
allowed), and returns ``o [total_q, Hq, Dv]`` and ``lse [Hq, total_q]``. :func:`pack` and
:func:`unpack_result` convert between the two; padded query rows come back as empty rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult


@dataclass(frozen=True, eq=False)
class PackedVarlen:
    """The packed inputs of a case: concatenated valid rows and their offsets."""

    q: np.ndarray  # [total_q, Hq, D]
    k: np.ndarray  # [total_k, Hkv, D]
    v: np.ndarray  # [total_k, Hkv, Dv]
    cu_seqlens_q: np.ndarray  # int32 [B + 1]
    cu_seqlens_k: np.ndarray  # int32 [B + 1]

    @property
    def max_seqlen_q(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

    @property
    def max_seqlen_k(self) -> int:
        return int(np.diff(self.cu_seqlens_k).max(initial=0))


def cu_seqlens(lengths: tuple[int, ...] | list[int]) -> np.ndarray:
    """int32 ``[B + 1]`` offsets ``[0, n_0, n_0 + n_1, ...]`` of the given lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def pack(case: AttentionCase) -> PackedVarlen:
    """The valid rows of ``case`` concatenated per sequence (padding dropped)."""
    q_lengths = [case.q_length(b) for b in range(case.B)]
    k_lengths = [case.k_length(b) for b in range(case.B)]
    return PackedVarlen(
        q=np.concatenate([case.q[b, :n] for b, n in enumerate(q_lengths)]),
        k=np.concatenate([case.k[b, :n] for b, n in enumerate(k_lengths)]),
        v=np.concatenate([case.v[b, :n] for b, n in enumerate(k_lengths)]),
        cu_seqlens_q=cu_seqlens(q_lengths),
        cu_seqlens_k=cu_seqlens(k_lengths),
    )


def unpack_result(case: AttentionCase, o: np.ndarray, lse: np.ndarray | None) -> AttentionResult:
    """A packed kernel's ``o [total_q, Hq, Dv]`` and ``lse [Hq, total_q]`` in the padded
    layout of ``case``; padded query rows are empty rows (O = 0, LSE = -inf or the sink)."""
    cu = cu_seqlens([case.q_length(b) for b in range(case.B)])
    if o.shape != (int(cu[-1]), case.Hq, case.Dv):
        raise ValueError(
            f"o shape {o.shape} must be [total_q, Hq, Dv]={(int(cu[-1]), case.Hq, case.Dv)}"
        )
    if lse is not None and lse.shape != (case.Hq, int(cu[-1])):
        raise ValueError(f"lse shape {lse.shape} must be [Hq, total_q]={(case.Hq, int(cu[-1]))}")
    out = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
    empty = -np.inf if case.sink is None else case.sink[None, :, None]
    out_lse = np.broadcast_to(empty, (case.B, case.Hq, case.Sq)).astype(np.float64)
    for b in range(case.B):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n = rows.stop - rows.start
        out[b, :n] = o[rows]
        if lse is not None:
            out_lse[b, :, :n] = lse[:, rows]
    return AttentionResult(o=out, lse=None if lse is None else out_lse)
