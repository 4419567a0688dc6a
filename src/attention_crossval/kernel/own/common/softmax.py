"""Online softmax over KV blocks, one query row per register-tile row, in CuTe DSL.

Per row, after each block of raw scores ``s`` (unscaled, masked entries ``-inf``):

    m_new = max(m, max_j s_j)                     running max, unscaled
    alpha = exp2((m - m_new) * scale_log2)        rescale factor for O and the running sum
    p_j   = exp2(s_j * scale_log2 - m_new * scale_log2)   one FFMA + ex2.approx.ftz.f32
    l     = l * alpha + sum_j p_j

with ``scale_log2 = log2(e) * softmax_scale`` folded into one constant. A row that has seen no
visible key keeps ``m = -inf``; the max is then read as 0 so that ``p = alpha = 0`` instead of
``exp2(-inf + inf) = NaN``. :meth:`OnlineSoftmax.finalize` returns ``1 / l`` (0 for an empty
row, so ``O = 0``; a NaN sum stays NaN) and ``LSE = (m * scale_log2 + log2(l)) * ln 2`` (natural
log; ``-inf`` when ``l = 0``), the project's conventions (reference/masks.py,
docs/design.md#empty-rows).

Each row's values are spread over ``threads_per_row`` lanes of a warp (4 for the SM90 WGMMA and
SM80 mma accumulators, 1 for a thread-per-row SM100 softmax); the row max is all-reduced across
them every block, the row sum only once in :meth:`finalize`.

Inside a thread, a row's max and its block sum are each taken over :data:`PARTIALS` interleaved
partial results combined by a tree (:func:`reduce_row`), not one chain through every column: a
chain of 32 dependent ``max`` or ``add`` instructions per row would sit on the critical path
between the two GEMMs. The max is exact in any order; the sum's order is one more way of adding
positive terms, which the derived bound covers (docs/numerics.md, section 4: the bound holds for
every summation order).

Two compile-time options an FP8 kernel needs (both 0 by default, and then they emit nothing):

* ``max_offset_log2``: ``p_j = exp2(s_j * scale_log2 - m_new * scale_log2 + max_offset_log2)``,
  P scaled by ``2^max_offset`` into the FP8 range before its conversion; ``l`` carries the same
  factor, so ``O / l`` cancels it, and the LSE subtracts it.
* ``rescale_threshold_log2``: the lazy rescale. The running max is raised only when the block's
  max exceeds it by more than this many log2 units (``(m_blk - m) * scale_log2 > threshold``);
  otherwise the stale max stays and ``alpha = 1``, so ``p`` can reach
  ``2^(threshold + max_offset)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Independent partial results per row and reduction (max, sum): enough to hide the latency of a
# dependent FMNMX/FADD chain, few enough to cost no registers.
PARTIALS = 4


def reduce_row(values: list, combine: Callable) -> object:
    """``combine`` over ``values`` (trace-time Python: the DSL sees ``len(values) - 1``
    instructions): :data:`PARTIALS` interleaved partial results, partial ``j`` taking
    ``values[j], values[j + PARTIALS], ...``, then combined as a balanced tree."""
    partials = list(values[:PARTIALS])
    for i in range(len(partials), len(values)):
        partials[i % PARTIALS] = combine(partials[i % PARTIALS], values[i])
    while len(partials) > 1:
        paired = [combine(a, b) for a, b in zip(partials[::2], partials[1::2], strict=False)]
        partials = paired + partials[len(paired) * 2 :]
    return partials[0]


class OnlineSoftmax:
    """Running row max and row sum for the ``num_rows`` rows one thread holds."""

    def __init__(
        self,
        num_rows: int,
        threads_per_row: int,
        scale_log2: Float32,
        *,
        max_offset_log2: float = 0.0,
        rescale_threshold_log2: float = 0.0,
    ) -> None:
        self.num_rows = num_rows
        self.threads_per_row = threads_per_row
        self.scale_log2 = scale_log2
        self.max_offset_log2 = max_offset_log2
        self.rescale_threshold_log2 = rescale_threshold_log2
        self.row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        self.row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    # The DSL carries this object through dynamic loops as its MLIR values (the scale and the
    # two register tensors); the row count, lanes per row, offset and threshold stay Python
    # constants.
    def _dynamic_fields(self) -> tuple[object, ...]:
        return (self.scale_log2, self.row_max, self.row_sum)

    def __extract_mlir_values__(self) -> list:
        values: list = []
        self._value_counts = []
        for obj in self._dynamic_fields():
            obj_values = cutlass.extract_mlir_values(obj)
            values += obj_values
            self._value_counts.append(len(obj_values))
        return values

    def __new_from_mlir_values__(self, values: list) -> OnlineSoftmax:
        new = object.__new__(OnlineSoftmax)
        new.num_rows, new.threads_per_row = self.num_rows, self.threads_per_row
        new.max_offset_log2 = self.max_offset_log2
        new.rescale_threshold_log2 = self.rescale_threshold_log2
        rebuilt, start = [], 0
        for obj, count in zip(self._dynamic_fields(), self._value_counts, strict=True):
            rebuilt.append(cutlass.new_from_mlir_values(obj, values[start : start + count]))
            start += count
        new.scale_log2, new.row_max, new.row_sum = rebuilt
        return new

    @cute.jit
    def update(self, scores: cute.Tensor, alpha: cute.Tensor) -> None:
        """Turn ``scores`` (``(rows, cols)`` view, masked entries ``-inf``) into ``p`` in place
        and write each row's O rescale factor into ``alpha``."""
        cols = cute.size(scores, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            row = [scores[r, c] for c in range(cols)]
            row_max = reduce_row([self.row_max[r], *row], cute.arch.fmax)
            row_max = cute.arch.warp_reduction_max(row_max, threads_in_group=self.threads_per_row)
            if cutlass.const_expr(self.rescale_threshold_log2 != 0.0):
                # Lazy rescale: keep the stale max unless the new one exceeds it by more than
                # the threshold (a first finite max always does: inf > threshold).
                if (row_max - self.row_max[r]) * self.scale_log2 <= self.rescale_threshold_log2:
                    row_max = self.row_max[r]
            safe_max = row_max
            if row_max == -Float32.inf:
                safe_max = Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            if cutlass.const_expr(self.max_offset_log2 != 0.0):
                max_scaled = max_scaled - self.max_offset_log2  # p scaled by 2^max_offset
            row_alpha = cute.math.exp2(
                (self.row_max[r] - safe_max) * self.scale_log2, fastmath=True
            )
            for c in cutlass.range_constexpr(cols):
                scores[r, c] = cute.math.exp2(
                    scores[r, c] * self.scale_log2 - max_scaled, fastmath=True
                )
            block_sum = reduce_row([scores[r, c] for c in range(cols)], _add)
            self.row_sum[r] = self.row_sum[r] * row_alpha + block_sum
            self.row_max[r] = row_max
            alpha[r] = row_alpha

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor) -> None:
        """Write ``1 / l`` (0 for empty rows) into ``inv_sum`` and the natural-log LSE into
        ``lse`` (``-inf`` for empty rows)."""
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = cute.arch.warp_reduction_sum(
                self.row_sum[r], threads_in_group=self.threads_per_row
            )
            # Only an exactly empty row is special: a NaN sum (NaN input) must stay visible.
            inv = Float32(1.0) / row_sum
            # l carries p's 2^max_offset (0 without an offset), which the LSE takes out.
            log2_sum = cute.math.log2(row_sum)
            if cutlass.const_expr(self.max_offset_log2 != 0.0):
                log2_sum = log2_sum - self.max_offset_log2
            row_lse = (self.row_max[r] * self.scale_log2 + log2_sum) * LN_2
            if row_sum == 0.0:
                inv = Float32(0.0)
                row_lse = -Float32.inf
            inv_sum[r] = inv
            lse[r] = row_lse


def _add(a: Float32, b: Float32) -> Float32:
    return a + b


@cute.jit
def rescale_rows(acc: cute.Tensor, factor: cute.Tensor) -> None:
    """``acc[r, :] *= factor[r]`` for a ``(rows, cols)`` view (O rescale and normalization)."""
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            acc[r, c] = acc[r, c] * factor[r]
