"""Likely causes of a failing forward verdict, named from the shape of the kernel's error.

The chain hint (:func:`kernel.harness.verdict.chain_hint`) names a precision slip; these name two
implementation slips whose findings otherwise look generic (a kernel that forgot its causal mask
shows up as ``empty-rows`` failures only):

* ``mask?``: every wrong row agrees with attention under a neighbouring mask: no causal mask
  (the row sees keys past the diagonal) or the other causal alignment;
* ``row sum?``: every wrong row is the reference times a per-row factor other than 1: the right
  weights (and max), divided by the wrong sum.

A row is wrong when it is off the float64 reference by more than :data:`ROW_TOLERANCE_EPS` of
the output dtype's epsilons, relative to the largest visible |V| of its head (|O| never exceeds
it); it is explained when the alternative lies within that tolerance. The hints only run on
findings, and only below :data:`MAX_WORK` multiply-adds (each alternative is a float64 run).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attention_crossval.kernel.harness.references import float64_reference, work
from attention_crossval.kernel.harness.verdict import Finding
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment

ROW_TOLERANCE_EPS = 8.0
MAX_WORK = 1 << 26
HINTED_CHECKS = frozenset({"empty-rows", "bound", "lse"})


def with_cause_hints(
    case: AttentionCase, raw: AttentionResult, findings: list[Finding]
) -> list[Finding]:
    """``findings`` with a ``hint:`` line on each ``empty-rows`` / ``bound`` / ``lse`` finding
    when :func:`cause_hint` names a likely cause of the kernel's untranslated result ``raw``."""
    if not any(f.check in HINTED_CHECKS for f in findings):
        return findings
    line = cause_hint(case, raw)
    if line is None:
        return findings
    return [
        Finding(f.check, f"{f.message}\n  hint: {line}", f.case_path)
        if f.check in HINTED_CHECKS
        else f
        for f in findings
    ]


def cause_hint(case: AttentionCase, raw: AttentionResult) -> str | None:
    """ "mask? ..." or "row sum? ..." when every wrong row of ``raw`` is explained so; else
    None (also for cases above :data:`MAX_WORK` or without a wrong row)."""
    if work(case) > MAX_WORK:
        return None
    reference = float64_reference(case).o
    o = np.asarray(raw.o, dtype=np.float64)
    tolerance = ROW_TOLERANCE_EPS * float(np.finfo(np.float32).eps)
    if case.dtype in ("float16", "bfloat16"):
        tolerance = ROW_TOLERANCE_EPS * 2.0 ** -(11 if case.dtype == "float16" else 8)
    scale = _v_scale(case)
    valid = _valid_rows(case)

    def off(expected: np.ndarray) -> np.ndarray:
        """Rows ``[B, Sq, Hq]`` of ``o`` farther than the tolerance from ``expected``."""
        with np.errstate(invalid="ignore"):
            distance = np.abs(o - expected).max(axis=-1) / scale
        return valid & ~(distance <= tolerance)

    wrong = off(reference)
    if not wrong.any():
        return None
    count = f"{int(wrong.sum())} wrong rows"
    for mask, change in _neighbour_masks(case):
        if not (wrong & off(float64_reference(dataclasses.replace(case, mask=mask)).o)).any():
            return f"mask? the {count} match attention with {change}"
    factor = _row_factor(o, reference)
    if not (wrong & off(reference * factor[..., None])).any():
        example = float(factor[wrong][0])
        return (
            f"row sum? the {count} are the reference times a per-row factor "
            f"(first {example:.6g}): the right weights and max, divided by the wrong sum"
        )
    return None


def _neighbour_masks(case: AttentionCase) -> list[tuple[object, str]]:
    """Masks one slip away from the case's: the causal mask dropped, the other alignment."""
    mask = case.mask
    if not mask.causal:
        return []
    other = (
        CausalAlignment.TOP_LEFT
        if mask.alignment is CausalAlignment.BOTTOM_RIGHT
        else CausalAlignment.BOTTOM_RIGHT
    )
    dropped = dataclasses.replace(mask, causal=False)
    neighbours = [(dropped, "no causal mask (keys past the diagonal)")]
    if case.Sq != case.Sk or mask.q_lengths is not None or mask.k_lengths is not None:
        neighbours.append(
            (dataclasses.replace(mask, alignment=other), f"the {other.value} causal alignment")
        )
    return neighbours


def _row_factor(o: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per row, the least-squares factor c of ``o ~ c * reference`` (1 on zero rows)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = (o * reference).sum(axis=-1) / (reference * reference).sum(axis=-1)
    return np.where(np.isfinite(factor), factor, 1.0)


def _v_scale(case: AttentionCase) -> np.ndarray:
    """Per row ``[B, 1, Hq]``, the largest |V| of its kv head over valid keys (at least tiny)."""
    v = np.abs(np.asarray(case.v, dtype=np.float64))
    for b in range(case.B):
        v[b, case.k_length(b) :] = 0.0
    per_head = v.max(axis=(1, 3))  # [B, Hkv]
    heads = [case.kv_head(h) for h in range(case.Hq)]
    return np.maximum(per_head[:, heads], np.finfo(np.float64).tiny)[:, None, :]


def _valid_rows(case: AttentionCase) -> np.ndarray:
    """Rows ``[B, Sq, Hq]`` inside ``q_lengths`` (padded rows follow their own convention)."""
    valid = np.zeros((case.B, case.Sq, case.Hq), dtype=bool)
    for b in range(case.B):
        valid[b, : case.q_length(b)] = True
    return valid
