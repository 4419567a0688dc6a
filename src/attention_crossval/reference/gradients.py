"""The backward case model: a forward case plus the upstream gradient, and the gradients.

Conventions (every tier and adapter follows them; ``docs/backward.md`` derives them):

* ``do [B, Sq, Hq, Dv]`` is the upstream gradient dL/dO, exact values of the case's input dtype.
  It must be finite except on padded query rows (past ``q_lengths``), which no kernel may read.
* Results: ``dq [B, Sq, Hq, D]``, ``dk [B, Sk, Hkv, D]``, ``dv [B, Sk, Hkv, Dv]``, float64.
  With GQA/MQA, ``dk``/``dv`` of a kv head are summed over the query heads of its group.
* An empty row (a valid query row that sees no key) has ``O = 0`` and contributes nothing:
  its dq row is 0 and it adds nothing to any dk/dv. Padded query rows and keys past
  ``k_lengths`` have zero gradient.
* ``softmax_scale`` enters dq and dk exactly once: ``dq_i = scale * sum_j dS_ij k_j`` and
  ``dk_j = scale * sum_i dS_ij q_i``, with ``dS_ij = P_ij (dO_i . v_j - D_i)`` and
  ``D_i = dO_i . O_i``.
* ``dlse [B, Hq, Sq]`` (optional) is the upstream gradient of the natural-log LSE. It adds
  ``P_ij * dlse_i`` to ``dS_ij`` (equivalently ``D_i -> D_i - dlse_i``). It is part of the
  model so that kernels whose LSE takes gradients fit without a redesign; tiers that do not
  implement it raise ``NotImplementedError`` for a case that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attention_crossval.reference.case import (
    AttentionCase,
    SavedFields,
    as_bits,
    native_byte_order,
)


@dataclass(frozen=True, eq=False)
class BackwardCase:
    """A forward case plus the upstream gradient ``do`` (and optionally ``dlse``)."""

    forward: AttentionCase
    do: np.ndarray
    dlse: np.ndarray | None = None
    label: str = ""

    def __post_init__(self) -> None:
        case = self.forward
        if not isinstance(case, AttentionCase):
            raise ValueError(f"forward must be an AttentionCase, got {type(case).__name__}")
        if not isinstance(self.do, np.ndarray):
            raise ValueError(f"do must be a numpy array, got {type(self.do).__name__}")
        object.__setattr__(self, "do", native_byte_order(self.do))  # as the forward's inputs
        expected = (case.B, case.Sq, case.Hq, case.Dv)
        if self.do.shape != expected:
            raise ValueError(f"do shape {self.do.shape} must be [B, Sq, Hq, Dv]={expected}")
        if self.do.dtype != case.q.dtype:
            raise ValueError(
                f"do.dtype={self.do.dtype.name} must equal the case's dtype {case.dtype}"
            )
        _check_finite_outside_padding("do", self.do, case)
        do = np.array(self.do, copy=True)
        do.setflags(write=False)
        object.__setattr__(self, "do", do)
        if self.dlse is not None:
            if not isinstance(self.dlse, np.ndarray):
                raise ValueError(f"dlse must be a numpy array, got {type(self.dlse).__name__}")
            shape = (case.B, case.Hq, case.Sq)
            if self.dlse.shape != shape:
                raise ValueError(f"dlse shape {self.dlse.shape} must be [B, Hq, Sq]={shape}")
            dlse = np.array(self.dlse, dtype=np.float64, copy=True)
            _check_finite_outside_padding("dlse", np.moveaxis(dlse, 2, 1), case)
            dlse.setflags(write=False)
            object.__setattr__(self, "dlse", dlse)

    def save(self, path: str | Path) -> Path:
        """Write the case (forward case plus ``do``) to ``path`` (.npz); returns the path."""
        forward = self.forward.save(path)
        with np.load(forward) as data:
            arrays = dict(data)
        arrays["do"] = as_bits(self.do)
        arrays["do_dtype"] = np.array(self.do.dtype.name)
        if self.dlse is not None:
            arrays["dlse"] = self.dlse
        np.savez_compressed(forward, **arrays)
        return forward

    @classmethod
    def load(cls, path: str | Path) -> BackwardCase:
        """Read a case written by :meth:`save`."""
        forward = AttentionCase.load(path)
        with np.load(path) as data:
            if "do" not in data:
                raise ValueError(f"{path} holds a forward case only (no 'do' array)")
            fields = SavedFields(data)
            do = fields.bits("do", forward.q.dtype)
            dlse = fields.array("dlse", "f") if "dlse" in data else None
        return cls(forward, do, dlse, forward.label)


@dataclass(frozen=True, eq=False)
class Gradients:
    """The gradients of any tier: ``dq [B, Sq, Hq, D]``, ``dk [B, Sk, Hkv, D]``,
    ``dv [B, Sk, Hkv, Dv]``, float64 holding the values the tier produced (already rounded
    to its output dtype where it emulates one)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def _check_finite_outside_padding(name: str, array: np.ndarray, case: AttentionCase) -> None:
    """``array [B, Sq, ...]`` must be finite on every valid query row."""
    bad = ~np.isfinite(array.astype(np.float64))
    if case.mask.q_lengths is not None:
        rows = np.arange(case.Sq)[None, :] < np.asarray(case.mask.q_lengths)[:, None]
        bad &= rows.reshape(rows.shape + (1,) * (array.ndim - 2))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be finite outside padding, found {array[index]} at {name}{list(index)}"
        )
