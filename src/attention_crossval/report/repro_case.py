"""A reproducer's case and figures: the failing case trimmed to what its failure needs, and what
the framework recorded on it (the kernel's value, float64 attention, the derived bound).

A trim drops batches, then key/value heads with their query heads, then query heads, then the
padding keys past every valid length; each is kept only when the kernel, rerun on the trimmed
case through the harness, still fails the same check (:func:`trim`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.known import covering
from attention_crossval.kernel.harness.references import CaseReferences
from attention_crossval.kernel.harness.verdict import Finding, Verdict
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.masks import empty_rows
from attention_crossval.report.repro_script import SCRIPT_CHECKS


@dataclass(frozen=True)
class Evidence:
    """The trimmed case, the check it fails and its finding, the figures for the script and the
    report (``recorded``), the per-element bounds the script checks against (``arrays``), the
    known findings covering it, the trims made (in words), and the case before them (None when
    no trim was tried)."""

    case: AttentionCase
    check: str
    finding: Finding
    recorded: dict[str, Any]
    arrays: dict[str, np.ndarray]
    known: tuple[KnownFinding, ...]
    trims: tuple[str, ...]
    original: str | None


def failed_checks(verdict: Verdict) -> list[str]:
    """The checks ``verdict`` failed, in the order found."""
    return list(dict.fromkeys(f.check for f in verdict.findings))


def choose_check(verdict: Verdict, wanted: str | None = None) -> str:
    """The check a reproducer shows: ``wanted`` when the verdict failed it, else the first
    failed check a script can apply on its own. ValueError when none."""
    failed = failed_checks(verdict)
    if wanted is not None:
        if wanted not in failed:
            raise ValueError(f"check={wanted!r} did not fail on this case (failed: {failed})")
        if wanted not in SCRIPT_CHECKS:
            raise ValueError(
                f"check={wanted!r}: a standalone script checks one of {sorted(SCRIPT_CHECKS)}"
            )
        return wanted
    for check in failed:
        if check in SCRIPT_CHECKS:
            return check
    if not failed:
        raise ValueError(f"the kernel passes this case ({verdict.case}): nothing to reproduce")
    raise ValueError(
        f"failed checks {failed}: none is one a standalone script can apply "
        f"({sorted(SCRIPT_CHECKS)})"
    )


def _rows(array: np.ndarray | None, axis: int, keep: slice | list[int]) -> np.ndarray | None:
    """``array`` with ``keep`` taken along ``axis``, unless that axis is broadcast (size 1)."""
    if array is None or array.shape[axis] == 1:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = keep
    return array[tuple(index)]


def one_batch(case: AttentionCase, b: int) -> AttentionCase:
    """Batch ``b`` of ``case`` alone."""
    mask = case.mask
    pick = slice(b, b + 1)
    lengths = {
        name: None if getattr(mask, name) is None else (getattr(mask, name)[b],)
        for name in ("q_lengths", "k_lengths")
    }
    new_mask = dataclasses.replace(mask, **lengths, explicit=_rows(mask.explicit, 0, pick))
    arrays = {name: getattr(case, name)[pick] for name in "qkv"}
    return dataclasses.replace(case, **arrays, mask=new_mask)


def some_heads(case: AttentionCase, kv: int, query: list[int]) -> AttentionCase:
    """Key/value head ``kv`` and the query heads ``query`` (all reading it)."""
    mask = dataclasses.replace(case.mask, explicit=_rows(case.mask.explicit, 1, query))
    sink = None if case.sink is None else case.sink[query]
    return dataclasses.replace(
        case,
        q=case.q[:, :, query],
        k=case.k[:, :, kv : kv + 1],
        v=case.v[:, :, kv : kv + 1],
        mask=mask,
        sink=sink,
    )


def first_keys(case: AttentionCase, count: int) -> AttentionCase:
    """The first ``count`` keys (at least every valid one: the masks read valid lengths)."""
    mask = dataclasses.replace(case.mask, explicit=_rows(case.mask.explicit, 3, slice(0, count)))
    return dataclasses.replace(case, k=case.k[:, :count], v=case.v[:, :count], mask=mask)


def _candidates(case: AttentionCase) -> list[tuple[str, Callable[[AttentionCase], list]]]:
    """The trim steps in order, each giving ``(words, trimmed case)`` candidates of a case."""

    def batches(c: AttentionCase) -> list:
        return [(f"batch {b} of {c.B}", one_batch(c, b)) for b in range(c.B)] if c.B > 1 else []

    def groups(c: AttentionCase) -> list:
        if c.Hkv == 1:
            return []
        g = c.group_size
        return [
            (f"kv head {kv} of {c.Hkv}", some_heads(c, kv, list(range(kv * g, kv * g + g))))
            for kv in range(c.Hkv)
        ]

    def heads(c: AttentionCase) -> list:
        if c.Hq == 1:
            return []
        return [
            (f"query head {h} of {c.Hq}", some_heads(c, c.kv_head(h), [h])) for h in range(c.Hq)
        ]

    def keys(c: AttentionCase) -> list:
        lengths = c.mask.k_lengths
        if lengths is None or max(lengths) in (0, c.Sk):
            return []
        return [(f"keys {max(lengths)} of {c.Sk} (padding dropped)", first_keys(c, max(lengths)))]

    return [("batches", batches), ("kv heads", groups), ("query heads", heads), ("keys", keys)]


def trim(
    case: AttentionCase, verdict: Verdict, check: str, run: Callable[[AttentionCase], Verdict]
) -> tuple[AttentionCase, Verdict, tuple[str, ...]]:
    """``case`` trimmed step by step (:func:`_candidates`), each trim kept only when ``run``
    on it still fails ``check``; returns the case, its verdict and the trims in words."""
    made: list[str] = []
    for _, step in _candidates(case):
        for words, candidate in step(case):
            again = run(candidate)
            if check in failed_checks(again):
                case, verdict = candidate, again
                made.append(words)
                break
    return case, verdict, tuple(made)


def gather(
    adapter: Any,
    case: AttentionCase,
    *,
    check: str | None = None,
    trimmed: bool = True,
    run: bool = True,
    attempts: int = 1,
) -> Evidence:
    """Run ``adapter`` on ``case``, choose the check to reproduce (:func:`choose_check`), trim
    the case (:func:`trim`) and record the figures (:func:`record`). Without ``run`` (a GPU
    kernel's script written on a machine without one), ``check`` is taken as given, the case as
    it is, and only the references' figures are recorded. A wanted ``check`` that does not fail
    gets up to ``attempts`` runs: a race fails on some runs only."""
    spec = adapter.spec
    reason = spec.unsupported(case)
    if reason is not None:
        raise ValueError(f"the case is outside {spec.name}'s declaration: {reason}")
    if not run:
        if check not in SCRIPT_CHECKS:
            raise ValueError(
                f"check={check!r}: a script written without running the kernel needs one of "
                f"{sorted(SCRIPT_CHECKS)}"
            )
        finding = Finding(check, "not run when this script was written (no device for it)")
        recorded, arrays = record(spec, case, None, finding)
        known = covering(spec, case, [finding])
        return Evidence(case, check, finding, recorded, arrays, known, (), None)
    if attempts < 1:
        raise ValueError(f"attempts={attempts} must be at least 1")
    for _ in range(attempts):
        verdict = run_case(adapter, case)
        if verdict.skipped is not None:
            raise ValueError(f"{spec.name} skipped the case: {verdict.skipped}")
        if check is None or check in failed_checks(verdict):
            break
    try:
        chosen = choose_check(verdict, check)
    except ValueError as reason:
        runs = f" in {attempts} runs" if attempts > 1 else ""
        raise ValueError(f"{reason}{runs}") from None
    original = case.describe() if trimmed else None
    trims: tuple[str, ...] = ()
    if trimmed:
        case, verdict, trims = trim(case, verdict, chosen, lambda c: run_case(adapter, c))
    finding = next(f for f in verdict.findings if f.check == chosen)
    recorded, arrays = record(spec, case, verdict.result, finding)
    known = covering(spec, case, [finding])
    return Evidence(case, chosen, finding, recorded, arrays, known, trims, original)


def record(
    spec: Any, case: AttentionCase, result: AttentionResult | None, finding: Finding
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The figures written into the script (``RECORDED``) and, for ``bound`` / ``lse``, the
    per-element bounds it checks against, derived from ``spec``'s declared chain
    (:meth:`kernel.references.CaseReferences.bounds`) around float64 attention; with the
    kernel's ``result``, also its worst element against them."""
    recorded: dict[str, Any] = {
        "finding": f"{finding.check}: {finding.message.splitlines()[0]}",
        "kernel": spec.name,
    }
    if finding.check not in ("bound", "lse"):
        return recorded, {}
    refs = CaseReferences(case, rows=0, device=spec.device, tile_m=spec.tile_m, tile_n=spec.tile_n)
    precision = spec.precision_for(case.dtype)
    bound, lse_bound = refs.bounds(
        precision, spec.block_n_for(case), tanh_error_ulp=spec.tanh_error_ulp
    )
    recorded["chain"] = chain_words(precision)
    name, limit = ("bound", bound) if finding.check == "bound" else ("lse_bound", lse_bound)
    arrays = {name: np.asarray(limit, np.float64)}
    if result is None:
        return recorded, arrays
    expected = refs.float64()
    seen = ~empty_rows(case)  # [B, Hq, Sq]
    lengths = np.array([case.q_length(b) for b in range(case.B)])
    rows = seen & (np.arange(case.Sq)[None, :] < lengths[:, None])[:, None, :]
    if finding.check == "bound":
        got, want, where, names = (
            result.o,
            expected.o,
            rows.transpose(0, 2, 1)[..., None],
            "b, i, h, d",
        )
    else:
        got, want, where, names = result.lse, expected.lse, rows, "b, h, i"
    error = np.abs(got - want)
    error = np.where(np.isnan(error), np.inf, error)
    ratio = np.divide(error, limit, out=np.where(error > 0, np.inf, 0.0), where=limit > 0)
    ratio = np.where(where, ratio, 0.0)
    at = tuple(int(x) for x in np.unravel_index(np.argmax(ratio), ratio.shape))
    recorded |= {
        "worst": f"({names}) = {at}",
        "kernel_value": float(got[at]),
        "float64_value": float(want[at]),
        "bound_at_worst": float(limit[at]),
        "error_over_bound": float(ratio[at]),
        "outside": int((ratio > 1).sum()),
    }
    return recorded, arrays


def chain_words(precision: Any) -> str:
    """A declared forward precision chain in words."""
    p = (
        f"P rounded to {precision.p_dtype} before P V, the row sum of the "
        f"{'rounded' if precision.row_sum_from_rounded_p else 'unrounded'} P"
        if precision.p_dtype
        else "P not rounded before P V"
    )
    out = precision.output_dtype or precision.accum_dtype
    mma = ""
    if precision.mma_accumulator_bits is not None:
        interval = precision.mma_promotion_interval
        promoted = "never promoted" if interval is None else f"promoted every {interval} products"
        mma = (
            f", FP8 MMAs with a {precision.mma_accumulator_bits}-bit accumulator "
            f"({precision.mma_accumulator_rounding}, {promoted})"
        )
    return (
        f"scores in {precision.score_dtype}, {p}, accumulators in {precision.accum_dtype}{mma}, "
        f"O rounded to {out}"
    )
