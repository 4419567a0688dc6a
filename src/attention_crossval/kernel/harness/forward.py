"""Defensive runner: a kernel's bugs show up as named findings, never as a dead test session.

For each case the kernel runs twice on a *poisoned* copy (NaN in every padding position the
case model lets a kernel never read; adapters add NaN guard bands around device inputs):

* run A with outputs prefilled with NaN, run B prefilled with zero (adapters that expose
  ``run_guarded(case, prefill=...)``; others allocate their own outputs);
* a third run on the clean case only when B holds unexpected non-finite values.

Checks (``CHECKS``, one vocabulary for findings and adapters). Always applied: ``error`` /
``crash`` / ``timeout`` (the latter two in an isolated worker, :mod:`kernel.harness.isolation`; the
case
is saved as .npz and a fresh worker continues), ``shape`` (``o`` / ``lse`` not float arrays of
the layout's shapes), ``input-write`` (q, k, v or the explicit mask changed by the call),
``empty-rows`` (empty rows, and padded query rows of a ``padded_rows="zero"`` kernel, differ
from O = 0 / LSE = -inf or the declared convention; like every tolerance check, through
:func:`reference.compare.outside_tolerance`, which matches an infinite expected value
exactly), ``lse`` (also: ``spec.returns_lse`` but no LSE returned). Applied where the
adapter's ``checks`` (a subset of :data:`ADAPTER_CHECKS`) names them: ``output-guard`` (a guard
band around ``o``/``lse`` changed), ``unwritten`` (the NaN prefill survives where the kernel
must write), ``padding-read`` (non-finite only when padding, or the unused slots of a paged
layout, hold NaN), ``nonfinite`` (non-finite on clean inputs; with NaN input guard bands this
also catches reads past a tensor's end), ``determinism`` (A and B differ in any bit, for a
``spec.deterministic`` kernel). With ``compare``: ``bound`` / ``lse`` (O / LSE outside the
derived error bound, against float64 on all rows and exact on sampled rows,
:mod:`kernel.harness.references`).
Declared convention differences (``spec.empty_rows``, ``spec.padded_rows``) are checked and
translated to the project convention, and listed in ``Verdict.declared``, never failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.checks import ADAPTER_CHECKS, CHECKS
from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.spec import KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.cause_hints import with_cause_hints
from attention_crossval.kernel.harness.execution import (
    KernelCrashed,
    Run,
    applied_checks,
    execute,
    private_copy,
)
from attention_crossval.kernel.harness.hidden_nan import hidden_nan_findings
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.references import (
    case_references,
    prefetched,
    reference_findings,
)
from attention_crossval.kernel.harness.saved_cases import kernel_spelling, store_kernel
from attention_crossval.kernel.harness.verdict import CheckFailed, Finding, Verdict
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.compare import outside_tolerance
from attention_crossval.reference.file_names import safe_file_name
from attention_crossval.reference.masks import empty_rows

__all__ = [
    "ADAPTER_CHECKS",
    "CHECKS",
    "CheckFailed",
    "Declined",
    "Finding",
    "IsolatedKernel",
    "Run",
    "Verdict",
    "applied_checks",
    "execute",
    "fill_padding",
    "run_case",
]

_BLOCKING = ("unwritten", "nonfinite", "padding-read")  # no reference checks after these


def fill_padding(case: AttentionCase, value: float) -> AttentionCase:
    """``case`` with ``value`` in q rows past ``q_lengths``, k/v rows past ``k_lengths`` and the
    slots of its paged layout that no sequence may read (``case.page_fill``): NaN poisons
    padding (reads show), 0 cleans it (for the triage run), so a kernel reading a page's unused
    tail is a ``padding-read`` like one reading past ``k_lengths``: the same read past the
    valid length, through the page table. Only arrays with lengths are copied (a case without
    padding comes back as it is: no copy of a 4 GiB K)."""
    arrays = {}
    lengths = {"q": case.mask.q_lengths, "k": case.mask.k_lengths, "v": case.mask.k_lengths}
    for name, valid in lengths.items():
        if valid is None:
            continue
        array = np.array(getattr(case, name))
        array[np.arange(array.shape[1])[None, :] >= np.asarray(valid)[:, None]] = value
        array.setflags(write=False)  # owned and read-only: the case takes it without a copy
        arrays[name] = array
    # every other field (options included) kept
    same_fill = np.array_equal(case.page_fill, value, equal_nan=True)
    if not arrays and (case.page_size is None or same_fill):
        return case
    return dataclasses.replace(case, **arrays, page_fill=value)


def run_case(
    adapter: KernelAdapter,
    case: AttentionCase,
    *,
    isolated: IsolatedKernel | None = None,
    repeats: int = 2,
    compare: bool = True,
    exact_rows: int = 4,
    finding_dir: str | Path | None = None,
    skip_checks: frozenset[str] = frozenset(),
) -> Verdict:
    """Run ``adapter`` on ``case`` under every applicable check and return the verdict.

    ``isolated`` runs the calls in that worker (``adapter`` then only supplies ``spec`` and
    ``checks``); an :class:`IsolatedKernel` passed as ``adapter`` is its own worker. Otherwise
    the calls run in this process. ``repeats`` >= 2 runs give the determinism check.
    ``compare`` adds the reference checks (``bound``, ``lse``). ``skip_checks`` leaves some of
    the adapter's cooperative checks out (a known ``padding-read`` rerun).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    if isolated is None and isinstance(adapter, IsolatedKernel):
        isolated = adapter
    spec = adapter.spec
    start = time.perf_counter()
    reason = spec.unsupported(case)
    if reason is not None:
        return Verdict(spec.name, case.describe(), skipped=reason)
    checks = applied_checks(adapter) - skip_checks
    poisoned = fill_padding(case, np.nan) if "padding-read" in checks else case
    # In a worker the kernel runs in another process: its references are computed meanwhile
    references = None
    if compare and isolated is not None:
        references = prefetched(case_references(case, spec, exact_rows), spec)

    def call(which: AttentionCase, prefill: str) -> Run:
        if isolated is not None:
            return isolated.call(which, prefill)
        # a private copy per call, as a worker gets: a kernel writing its inputs cannot change
        # the caller's case (the references are computed from it) or the next run's
        return execute(adapter, private_copy(which), prefill)

    raw = None  # the kernel's last result, untranslated: what the cause hints read
    try:
        runs = [call(poisoned, "nan" if i == 0 else "zero") for i in range(repeats)]
        raw = runs[-1].result
        findings, declared, result = _shape_findings(case, runs), [], None
        if not findings:
            findings, declared, result = _analyse(
                spec, checks, case, runs, lambda: call(fill_padding(case, 0.0), "zero").result
            )
            findings = _input_write_findings(runs) + findings
        if "hidden-nan" in checks and result is not None:
            # padding NaN only where padding reads are checked: not in a known one's rerun
            findings += hidden_nan_findings(
                case,
                result,
                lambda c: call(c, "zero").result,
                padding="padding-read" in checks,
            )
    except KernelCrashed as crash:
        findings, declared, result = [Finding(crash.check, str(crash))], [], None
    except Declined as declined:
        return Verdict(spec.name, case.describe(), skipped=f"declined by the kernel: {declined}")
    if compare and result is not None and not any(f.check in _BLOCKING for f in findings):
        refs = None if references is None else references()  # unjoined, it ends on its own
        findings += reference_findings(case, result, spec, exact_rows=exact_rows, references=refs)
    if findings and result is not None and raw is not None:
        findings = with_cause_hints(case, raw, findings)
    if findings and finding_dir is not None:
        path = _save(case, spec.name, findings[0].check, finding_dir)
        kernel = kernel_spelling(isolated.kernel if isolated else None, spec.name)
        if kernel is not None:  # for replay to rerun
            store_kernel(path, kernel)
        findings = [Finding(f.check, f.message, str(path)) for f in findings]
    return Verdict(
        spec.name,
        case.describe(),
        tuple(findings),
        applied=_applied(checks, spec, isolated=isolated is not None, compare=compare),
        declared=tuple(declared),
        result=result,
        seconds=time.perf_counter() - start,
    )


def _applied(
    checks: frozenset[str], spec: KernelSpec, *, isolated: bool, compare: bool
) -> frozenset[str]:
    """Every check a verdict applied: the adapter's and those that always apply."""
    always = {"error", "shape", "input-write", "empty-rows"}
    applied = checks | always | ({"crash", "timeout"} if isolated else set())
    return (
        applied
        | ({"lse"} if spec.returns_lse else set())
        | ({"bound", "lse"} if compare else set())
    )


def _save(case: AttentionCase, kernel: str, check: str, directory: str | Path) -> Path:
    """Save ``case``; the name's digest is of the case's bytes, the same in every process."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256(case.describe().encode())
    for array in (case.q, case.k, case.v):
        hasher.update(np.ascontiguousarray(array).tobytes())
    return case.save(
        directory / safe_file_name(kernel, check, hasher.hexdigest()[:16], suffix=".npz")
    )


def _shape_findings(case: AttentionCase, runs: list[Run]) -> list[Finding]:
    """``shape`` when a run's ``o`` / ``lse`` is not a real float array of the layout's shape:
    every later check would misread it, so the verdict has no result."""
    expected = {"o": (case.B, case.Sq, case.Hq, case.Dv), "lse": (case.B, case.Hq, case.Sq)}
    for run in runs:
        for name, shape in expected.items():
            value = getattr(run.result, name)
            if name == "lse" and value is None:
                continue
            if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
                what = type(value).__name__
                what += f" of {value.dtype}" if isinstance(value, np.ndarray) else ""
                return [Finding("shape", f"{name} must be a float NumPy array, got {what}")]
            if value.shape != shape:
                return [
                    Finding(
                        "shape", f"{name} has shape {list(value.shape)}, expected {list(shape)}"
                    )
                ]
    return []


def _input_write_findings(runs: list[Run]) -> list[Finding]:
    """``input-write`` when any run changed q, k, v or the explicit mask it was given."""
    written = sorted({message for run in runs for message in run.input_writes})
    return [Finding("input-write", "; ".join(written))] if written else []


@dataclass(frozen=True)
class _Rows:
    """Row masks ``[B, Sq, Hq]`` of a case under a spec: which rows a kernel must write, and
    which must be finite there."""

    empty: np.ndarray
    padded: np.ndarray
    must_write: np.ndarray
    must_be_finite: np.ndarray
    empty_lse: np.ndarray  # an empty row's LSE: -inf, or the head's sink logit

    @classmethod
    def of(cls, spec: KernelSpec, case: AttentionCase) -> _Rows:
        empty = empty_rows(case).transpose(0, 2, 1)
        padded = np.zeros_like(empty)
        for b in range(case.B):
            padded[b, case.q_length(b) :] = True
        must_write = ~padded if spec.padded_rows == "unwritten" else np.ones_like(empty)
        must_be_finite = must_write & ~(empty & (spec.empty_rows == "nan"))
        sink = np.full(case.Hq, -np.inf) if case.sink is None else case.sink.astype(np.float64)
        empty_lse = np.broadcast_to(sink, empty.shape)
        return cls(empty, padded, must_write, must_be_finite, empty_lse)

    def bad(self, result: AttentionResult) -> np.ndarray:
        """Rows that must be finite but hold a non-finite O or a NaN (or +-inf non-empty) LSE."""
        bad = ~np.isfinite(result.o).all(axis=-1)
        if result.lse is not None:
            lse = result.lse.transpose(0, 2, 1)
            bad |= np.isnan(lse) | (np.isinf(lse) & ~self.empty)
        return bad & self.must_be_finite


def _analyse(
    spec: KernelSpec,
    checks: frozenset[str],
    case: AttentionCase,
    runs: list[Run],
    clean_run: Any,
) -> tuple[list[Finding], list[str], AttentionResult]:
    """Turn the raw runs into findings; returns the (translated) result of the last run."""
    findings: list[Finding] = []
    rows = _Rows.of(spec, case)
    first, last = runs[0].result, runs[-1].result
    writes = sorted({w for run in runs for w in run.writes})
    if writes and "output-guard" in checks:
        findings.append(Finding("output-guard", "; ".join(writes)))
    if spec.returns_lse and any(run.result.lse is None for run in runs):
        findings.append(Finding("lse", "spec.returns_lse is True but the kernel returned lse=None"))
    unwritten = np.zeros_like(rows.empty)
    if "unwritten" in checks and len(runs) > 1:
        unwritten = rows.bad(first) & ~rows.bad(last)
        if unwritten.any():
            message = _rows_message(unwritten, "rows kept the NaN prefill (never written)")
            findings.append(Finding("unwritten", message))
    reported = unwritten.copy()
    if rows.bad(last).any():
        nonfinite, reported_nonfinite = _nonfinite_findings(checks, rows, last, clean_run)
        findings += nonfinite
        reported |= reported_nonfinite
    if spec.deterministic and "determinism" in checks and len(runs) > 1:
        findings += _determinism_findings(first, last, rows.must_write & ~unwritten)
    result, declared, empty_findings = _translate(spec, last, rows, reported)
    return findings + empty_findings, declared, result


def _nonfinite_findings(
    checks: frozenset[str], rows: _Rows, last: AttentionResult, clean_run: Any
) -> tuple[list[Finding], np.ndarray]:
    """Tell NaN-padding reads (``padding-read``) from non-finite values on clean inputs; with
    the rows reported (a row neither applied check reports stays for ``empty-rows``)."""
    findings = []
    clean_bad = rows.bad(clean_run())
    leaked = rows.bad(last) & ~clean_bad
    reported = np.zeros_like(leaked)
    if leaked.any() and "padding-read" in checks:
        what = "rows non-finite with NaN padding but finite with zero padding"
        findings.append(Finding("padding-read", _rows_message(leaked, what)))
        reported |= leaked
    if clean_bad.any() and "nonfinite" in checks:
        what = "rows non-finite with zero padding (NaN only in input guard bands, if any)"
        findings.append(Finding("nonfinite", _rows_message(clean_bad, what)))
        reported |= clean_bad
    return findings, reported


def _bits(values: np.ndarray) -> np.ndarray:
    """The float64 bit patterns of ``values``. Converting fp16/bf16/fp32 to float64 is exact and
    injective (sign of zero and NaN payloads kept), so equal patterns mean equal kernel bits."""
    return np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)


def _determinism_findings(
    first: AttentionResult, last: AttentionResult, compared: np.ndarray
) -> list[Finding]:
    """Elements of the ``compared`` rows ``[B, Sq, Hq]`` whose bits differ between two runs."""
    findings = []
    for name, where in (("o", compared[..., None]), ("lse", compared.transpose(0, 2, 1))):
        a, b = getattr(first, name), getattr(last, name)
        if a is None or b is None:
            continue
        differ = (_bits(a) != _bits(b)) & where
        if differ.any():
            index = tuple(int(x) for x in np.argwhere(differ)[0])
            findings.append(
                Finding(
                    "determinism",
                    f"{name}: {int(differ.sum())} elements differ bitwise between two runs; "
                    f"first at {index}: {a[index]!r} vs {b[index]!r}",
                )
            )
    return findings


def _rows_message(rows: np.ndarray, what: str) -> str:
    b, i, h = (int(x) for x in np.argwhere(rows)[0])
    return f"{int(rows.sum())} of {rows.size} {what}; first at (b={b}, i={i}, h={h})"


def _translate(
    spec: KernelSpec, result: AttentionResult, rows: _Rows, reported: np.ndarray
) -> tuple[AttentionResult, list[str], list[Finding]]:
    """Check empty rows (and padded rows of a ``padded_rows="zero"`` kernel) against the
    declaration, skipping rows ``reported`` by another check, and rewrite empty and padded
    rows as O = 0, LSE = -inf."""
    o = np.array(result.o)
    lse = None if result.lse is None else np.array(result.lse)
    notes: list[str] = []
    findings: list[Finding] = []
    checked = rows.empty & rows.must_write & ~reported
    if checked.any():
        rows_o = o[checked]
        nan_ok = spec.empty_rows == "nan"
        wrong = outside_tolerance(rows_o, 0.0, 0.0, nan_ok=nan_ok).any(axis=-1)
        if lse is not None:  # -inf exactly; a sink within 2^-20 relative (fp32 log2 round trip)
            got, expected = lse.transpose(0, 2, 1)[checked], rows.empty_lse[checked]
            wrong |= outside_tolerance(got, expected, 2**-20 * np.abs(expected))
        if wrong.any():
            findings.append(
                Finding(
                    "empty-rows",
                    f"{int(wrong.sum())} empty or padded rows not O = 0 / LSE = -inf (or sink) "
                    f"(declared empty_rows={spec.empty_rows!r}, "
                    f"padded_rows={spec.padded_rows!r})",
                )
            )
        if spec.empty_rows == "nan" and np.isnan(rows_o).any():
            count = int(np.isnan(rows_o).any(axis=-1).sum())
            notes.append(f"{count} empty rows gave NaN (declared; read as O = 0)")
    if spec.padded_rows == "unwritten" and rows.padded.any():
        count = int(rows.padded.sum())
        notes.append(f"{count} padded query rows not written (declared; read as O = 0)")
    o[rows.empty] = 0.0
    if lse is not None:
        lse.transpose(0, 2, 1)[rows.empty] = rows.empty_lse[rows.empty]
    return AttentionResult(o=o, lse=lse), notes, findings
