"""The reference tiers on a subset of query rows, for cases too big to evaluate on every row.

Rows are independent in attention, in the streaming tier (a row's K blocks do not depend on
which other rows share its row block) and in the derived bound (a row's terms depend on its own
visible keys and the K block boundaries). So the float64 result, the emulated streaming result
and the bound of query rows ``R`` can be computed on a *sub-case* that holds only those rows:
same K/V, same softmax scale, and each row's exact visibility carried over as an explicit mask
(plus the key lengths, so padded keys are still never read). Results are scattered back into
full-shape arrays with NaN on the rows not evaluated, which ``reference.compare`` skips.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.masks import visible


@dataclass(frozen=True, eq=False)
class RowSubset:
    """Query positions ``positions`` (sorted, shared by every batch and head) of ``full``, and
    the sub-case ``case`` holding only them."""

    full: AttentionCase
    positions: np.ndarray
    case: AttentionCase

    @classmethod
    def of(cls, full: AttentionCase, positions) -> RowSubset:
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        if positions.size == 0 or positions[0] < 0 or positions[-1] >= full.Sq:
            raise ValueError(f"positions must be non-empty query positions in [0, {full.Sq})")
        seen = np.stack(
            [
                np.stack([visible(full, b, h, positions) for h in range(full.Hq)])
                for b in range(full.B)
            ]
        )
        q_lengths = full.mask.q_lengths
        if q_lengths is not None:  # sorted positions: the valid rows of batch b come first
            q_lengths = tuple(int(np.sum(positions < n)) for n in q_lengths)
        mask = Mask(q_lengths=q_lengths, k_lengths=full.mask.k_lengths, explicit=seen)
        sub = dataclasses.replace(full, q=full.q[:, positions], mask=mask)
        return cls(full, positions, sub)

    def row_mask(self) -> np.ndarray:
        """Bool ``[B, Hq, Sq]``: the evaluated rows of the full case."""
        mask = np.zeros((self.full.B, self.full.Hq, self.full.Sq), dtype=bool)
        mask[:, :, self.positions] = True
        return mask

    def scatter_o(self, o: np.ndarray) -> np.ndarray:
        """``[B, len(R), Hq, Dv]`` -> ``[B, Sq, Hq, Dv]`` with NaN on rows not evaluated."""
        full = np.full((self.full.B, self.full.Sq, self.full.Hq, o.shape[-1]), np.nan)
        full[:, self.positions] = o
        return full

    def scatter_rows(self, values: np.ndarray) -> np.ndarray:
        """``[B, Hq, len(R)]`` -> ``[B, Hq, Sq]`` with NaN on rows not evaluated."""
        full = np.full((self.full.B, self.full.Hq, self.full.Sq), np.nan)
        full[:, :, self.positions] = values
        return full

    def scatter(self, result: AttentionResult) -> AttentionResult:
        lse = None if result.lse is None else self.scatter_rows(result.lse)
        return AttentionResult(o=self.scatter_o(result.o), lse=lse)

    def index(self, row: int) -> int:
        """Position of full-case query row ``row`` in the sub-case (it must be evaluated)."""
        return int(np.searchsorted(self.positions, row))
