"""A CPU kernel that trusts its lengths, as a C kernel would: the validation property's target.

:class:`LaxLengthsAdapter` declares ``validates_lengths`` but checks nothing: it reads each
sequence's q, k and v rows straight from memory for ``q_lengths[b]`` / ``k_lengths[b]`` rows
(NumPy ``as_strided``, no bounds), so a length past the tensor reads whatever follows it (in the
property: a NaN guard band), a negative length loops zero times and answers silently, and a
length list one batch short or long is read without complaint. On lengths that agree with its
tensors it is plain float64 softmax attention over the valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult


def _spec() -> KernelSpec:
    return KernelSpec(
        name="cpu-lax-lengths",
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_dims=frozenset({8, 16, 32, 64}),
        mask_kinds=frozenset({"varlen"}),
        tile_m=16,
        tile_n=16,
        device="cpu",
        validates_lengths=True,  # a false claim: the property must catch it
    )


def _rows(array: np.ndarray, b: int, count: int) -> np.ndarray:
    """``count`` rows of batch ``b`` read from memory with the tensor's strides, unchecked."""
    rows = max(count, 0)  # a loop "for i in range(count)" runs zero times when negative
    start = array[b]
    return as_strided(start, shape=(rows, *start.shape[1:]), strides=start.strides, writeable=False)


@dataclass
class LaxLengthsAdapter:
    """The module docstring's kernel."""

    spec: KernelSpec = field(default_factory=_spec)

    def __call__(self, case: AttentionCase) -> AttentionResult:
        o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
        lse = np.full((case.B, case.Hq, case.Sq), -np.inf)
        q_lengths = case.mask.q_lengths or (case.Sq,) * case.B
        k_lengths = case.mask.k_lengths or (case.Sk,) * case.B
        for b in range(case.B):  # the tensors' batches; the lengths are indexed, not checked
            q = _rows(case.q, b, q_lengths[b]).astype(np.float64)
            k = _rows(case.k, b, k_lengths[b]).astype(np.float64)
            v = _rows(case.v, b, k_lengths[b]).astype(np.float64)
            if not (len(q) and len(k)):
                continue
            k, v = (np.repeat(x, case.group_size, axis=1) for x in (k, v))
            with np.errstate(all="ignore"):  # NaN read from past the tensors propagates
                scores = np.einsum("ihd,jhd->hij", q, k) * case.softmax_scale
                top = scores.max(axis=-1, keepdims=True)
                weights = np.exp(scores - top)
                total = weights.sum(axis=-1, keepdims=True)
                rows = min(len(q), case.Sq)  # rows past Sq would be written out of bounds
                o[b, :rows] = np.einsum("hij,jhd->ihd", weights / total, v)[:rows]
                lse[b, :, :rows] = (top + np.log(total))[..., 0][:, :rows]
        return AttentionResult(o=o, lse=lse)


def create() -> LaxLengthsAdapter:
    return LaxLengthsAdapter()
