"""Defensive runner for the backward pass: a kernel's dq/dk/dv bugs become named findings.

The same machinery and vocabulary as the forward (:mod:`kernel.harness.forward`): per case the
kernel
runs ``repeats`` times on a *poisoned* copy (NaN in the padding of q, k, v and dO), run A with
dq/dk/dv prefilled with NaN, the others with zero (adapters exposing
``run_backward_guarded(case, prefill=...)`` inside guard bands; others allocate their own
gradients), in an isolated worker when given one (:mod:`kernel.harness.isolation`).

Checks (:data:`kernel.contract.checks.BACKWARD_CHECKS`): ``error`` / ``crash`` / ``timeout``; where
the
adapter's
``backward_checks`` name them ``output-guard``, ``unwritten``, ``padding-read``,
``nonfinite``, ``determinism``; always ``zero-grad`` (empty and padded query rows must have
dq = 0, keys no query sees and keys past ``k_lengths`` dk = dv = 0; padding only when the
kernel declares ``padded_rows="zero"``); with ``compare``: ``dq-bound``, ``dk-bound``,
``dv-bound`` (outside the derived bound against float64 on every element or exact on
samples, with the three-tier triage).

Determinism: a ``spec.backward_deterministic`` kernel must repeat bitwise (``determinism``);
any other kernel's runs are each held to the bound, and how much they differ is reported in
:attr:`BackwardVerdict.run_to_run`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.spec import BackwardKernelAdapter, KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.execution import (
    KernelCrashed,
    backward_checks,
    execute_backward,
    private_copy,
)
from attention_crossval.kernel.harness.forward import fill_padding
from attention_crossval.kernel.harness.isolation import (
    IsolatedKernel,
)
from attention_crossval.kernel.harness.references_backward import GRADIENTS, BackwardReferences
from attention_crossval.kernel.harness.saved_cases import kernel_spelling, store_kernel
from attention_crossval.kernel.harness.verdict import Finding, Verdict
from attention_crossval.reference.compare import outside_tolerance
from attention_crossval.reference.file_names import safe_file_name
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible

_BLOCKING = ("unwritten", "nonfinite", "padding-read")  # no reference checks after these
# Kernel and emulation are each within the bound of the exact value: their difference within 2x.
KERNEL_VS_STREAMING_SCALE = 2.0


@dataclass(frozen=True)
class RunToRun:
    """How the repeated backward runs compared: ``differing`` elements (any bit) over dq, dk
    and dv, and the largest absolute difference; ``required`` when the kernel declares a
    bitwise-deterministic backward."""

    runs: int
    required: bool
    differing: int
    max_abs_diff: float

    @property
    def bitwise_equal(self) -> bool:
        return self.differing == 0


@dataclass(frozen=True)
class BackwardVerdict(Verdict):
    """A :class:`~kernel.harness.verdict.Verdict` whose result holds the (translated) gradients of
    the
    last run, plus the run-to-run comparison."""

    result: Gradients | None = None
    run_to_run: RunToRun | None = None


def fill_backward_padding(case: BackwardCase, value: float) -> BackwardCase:
    """A copy of ``case`` with ``value`` in the padding of q, k, v (:func:`kernel.harness.forward.
    fill_padding`) and in dO rows past ``q_lengths``."""
    do = np.array(case.do)
    if case.forward.mask.q_lengths is not None:
        do[np.arange(do.shape[1])[None, :] >= np.asarray(case.forward.mask.q_lengths)[:, None]] = (
            value
        )
    return BackwardCase(fill_padding(case.forward, value), do, case.dlse, case.label)


def unsupported_backward(spec: KernelSpec, case: BackwardCase) -> str | None:
    """Why the kernel's backward need not handle ``case``, or None."""
    if not spec.backward:
        return "no backward declared (spec.backward is False)"
    if case.dlse is not None:
        return "an upstream LSE gradient (dlse) is not part of the backward harness yet"
    dims, f = spec.backward_head_dims, case.forward
    if dims is not None and (f.D not in dims or f.Dv != f.D):
        return f"backward declared for D = Dv in {sorted(dims)} only (D={f.D}, Dv={f.Dv})"
    return spec.unsupported(case.forward)


def run_backward_case(
    adapter: KernelAdapter,
    case: BackwardCase,
    *,
    isolated: IsolatedKernel | None = None,
    repeats: int = 2,
    compare: bool = True,
    samples: int = 4,
    finding_dir: str | Path | None = None,
    references: BackwardReferences | None = None,
    skip_checks: frozenset[str] = frozenset(),
) -> BackwardVerdict:
    """Run ``adapter``'s backward on ``case`` under every applicable check.

    ``isolated`` runs the calls in that worker (``adapter`` then only supplies ``spec`` and
    ``backward_checks``). ``repeats`` >= 2 gives the determinism check. ``compare`` adds the
    ``dq-bound`` / ``dk-bound`` / ``dv-bound`` checks with ``samples`` exact rows and keys
    (or the given ``references``).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    spec = adapter.spec
    start = time.perf_counter()
    described = case.forward.describe()
    reason = unsupported_backward(spec, case)
    if reason is not None:
        return BackwardVerdict(spec.name, described, skipped=reason)
    if isolated is None and isinstance(adapter, IsolatedKernel):
        isolated = adapter
    if isolated is None and not isinstance(adapter, BackwardKernelAdapter):
        raise ValueError(
            f"{type(adapter).__name__}: spec.backward is True, so it must have "
            "backward(case: BackwardCase) -> Gradients"
        )
    checks = backward_checks(adapter) - skip_checks
    poisoned = fill_backward_padding(case, np.nan) if "padding-read" in checks else case

    input_writes: list[str] = []

    def call(which: BackwardCase, prefill: str) -> tuple[Gradients, tuple[str, ...]]:
        if isolated is not None:
            run = isolated.call(which, prefill, method="backward")
        else:  # a private copy, as a worker gets: the references are computed from ``case``
            run = execute_backward(adapter, private_copy(which), prefill)
        input_writes.extend(run.input_writes)
        return run.result, run.writes

    expected = _Expected.of(spec, case)
    run_to_run, clean = None, None
    try:
        runs = [call(poisoned, "nan" if i == 0 else "zero") for i in range(repeats)]
        findings, result, unwritten, clean = _analyse(
            checks, expected, runs, lambda: call(fill_backward_padding(case, 0.0), "zero")[0]
        )
        findings += [Finding("input-write", message) for message in input_writes[:1]]
        run_to_run = _run_to_run(spec, runs, expected, unwritten)
        if run_to_run.required and "determinism" in checks and not run_to_run.bitwise_equal:
            findings.append(Finding("determinism", _determinism_message(runs, expected)))
    except KernelCrashed as crash:
        findings, result = [Finding(crash.check, str(crash))], None
    except Declined as declined:
        skipped = f"declined by the kernel: {declined}"
        return BackwardVerdict(spec.name, described, skipped=skipped)
    refs = None
    if compare and clean is not None and any(f.check == "nonfinite" for f in findings):
        refs = references or BackwardReferences(case, samples=samples, device=spec.device)
        bounds = refs.bounds(spec.backward_precision_for(case.forward.dtype), spec.tile_n)
        findings, note = _excuse_overflow(findings, clean, expected, refs.float64(), bounds)
        expected = dataclasses.replace(expected, notes=expected.notes + note)
    if compare and result is not None and not any(f.check in _BLOCKING for f in findings):
        refs = refs or references or BackwardReferences(case, samples=samples, device=spec.device)
        distinct = [result] if run_to_run is None or run_to_run.bitwise_equal else None
        tested = distinct or [expected.translate(r) for r, _ in runs]
        findings += bound_findings(refs, spec, tested)
    if findings and finding_dir is not None:
        path = _save(case, spec.name, findings[0].check, finding_dir)
        kernel = kernel_spelling(isolated.kernel if isolated else None, spec.name)
        if kernel is not None:  # for replay to rerun
            store_kernel(path, kernel)
        findings = [Finding(f.check, f.message, str(path)) for f in findings]
    return BackwardVerdict(
        spec.name,
        described,
        tuple(findings),
        applied=_applied(checks, isolated=isolated is not None, compare=compare),
        declared=tuple(expected.notes) if result is not None else (),
        result=result,
        seconds=time.perf_counter() - start,
        run_to_run=run_to_run,
    )


def _applied(checks: frozenset[str], *, isolated: bool, compare: bool) -> frozenset[str]:
    """Every check a backward verdict applied."""
    applied = checks | {"error", "zero-grad"} | ({"crash", "timeout"} if isolated else set())
    return applied | ({f"{g}-bound" for g in GRADIENTS} if compare else set())


def _save(case: BackwardCase, kernel: str, check: str, directory: str | Path) -> Path:
    """Save ``case`` under a name digesting its bytes (the forward's naming, plus dO)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256(case.forward.describe().encode())
    for array in (case.forward.q, case.forward.k, case.forward.v, case.do):
        hasher.update(np.ascontiguousarray(array).tobytes())
    name = safe_file_name(kernel, "backward", check, hasher.hexdigest()[:16], suffix=".npz")
    return case.save(directory / name)


@dataclass(frozen=True)
class _Expected:
    """Per gradient, bool masks over its rows (``[B, Sq, Hq]`` for dq, ``[B, Sk, Hkv]`` for
    dk and dv): where the kernel must write, and where the convention says 0."""

    must_write: dict[str, np.ndarray]
    zero: dict[str, np.ndarray]
    notes: tuple[str, ...]

    @classmethod
    def of(cls, spec: KernelSpec, case: BackwardCase) -> _Expected:
        fwd = case.forward
        empty = np.zeros((fwd.B, fwd.Sq, fwd.Hq), dtype=bool)
        unseen = np.ones((fwd.B, fwd.Sk, fwd.Hkv), dtype=bool)
        padded_q = (
            np.arange(fwd.Sq)[None, :] >= np.array([fwd.q_length(b) for b in range(fwd.B)])[:, None]
        )
        padded_k = (
            np.arange(fwd.Sk)[None, :] >= np.array([fwd.k_length(b) for b in range(fwd.B)])[:, None]
        )
        for b in range(fwd.B):
            for h in range(fwd.Hq):
                seen = visible(fwd, b, h)
                empty[b, :, h] = ~seen.any(axis=1)
                unseen[b, :, fwd.kv_head(h)] &= ~seen.any(axis=0)
        rows = {"dq": padded_q[..., None], "dk": padded_k[..., None], "dv": padded_k[..., None]}
        zero = {"dq": empty, "dk": unseen, "dv": unseen}
        notes: list[str] = []
        if spec.padded_rows == "unwritten":
            must_write = {g: ~np.broadcast_to(rows[g], zero[g].shape) for g in GRADIENTS}
            count = {g: int((~must_write[g]).sum()) for g in GRADIENTS}
            if any(count.values()):
                notes.append(
                    f"padded rows not checked (declared padded_rows='unwritten'; read as 0): "
                    f"dq {count['dq']}, dk/dv {count['dk']}"
                )
        else:
            must_write = {g: np.ones(zero[g].shape, dtype=bool) for g in GRADIENTS}
        return cls(must_write, zero, tuple(notes))

    def bad(self, result: Gradients) -> dict[str, np.ndarray]:
        """Rows that must be written but hold a non-finite value, per gradient."""
        return {
            g: ~np.isfinite(getattr(result, g)).all(axis=-1) & self.must_write[g] for g in GRADIENTS
        }

    def translate(self, result: Gradients) -> Gradients:
        """Rows the kernel need not write (declared) read as 0, as the convention has them."""
        arrays = {}
        for g in GRADIENTS:
            array = np.array(getattr(result, g), dtype=np.float64)
            array[~self.must_write[g]] = 0.0
            arrays[g] = array
        return Gradients(**arrays)


def _analyse(
    checks: frozenset[str],
    expected: _Expected,
    runs: list[tuple[Gradients, tuple[str, ...]]],
    clean_run: Any,
) -> tuple[list[Finding], Gradients, dict[str, np.ndarray], Gradients | None]:
    """Findings of the raw runs; the translated last result; the unwritten rows per gradient;
    the zero-padding run when one was needed (a run had non-finite rows)."""
    findings: list[Finding] = []
    first, last = runs[0][0], runs[-1][0]
    writes = sorted({w for _, run_writes in runs for w in run_writes})
    if writes and "output-guard" in checks:
        findings.append(Finding("output-guard", "; ".join(writes)))
    bad_first, bad_last = expected.bad(first), expected.bad(last)
    unwritten = {g: np.zeros_like(bad_last[g]) for g in GRADIENTS}
    if "unwritten" in checks and len(runs) > 1:
        unwritten = {g: bad_first[g] & ~bad_last[g] for g in GRADIENTS}
        message = _rows_message(unwritten, "rows kept the NaN prefill (never written)")
        if message:
            findings.append(Finding("unwritten", message))
    clean = None
    reported = {g: unwritten[g].copy() for g in GRADIENTS}  # rows an applied check reports
    if any(bad.any() for bad in bad_last.values()):
        clean = clean_run()
        clean_bad = expected.bad(clean)
        leaked = {g: bad_last[g] & ~clean_bad[g] for g in GRADIENTS}
        for check, rows, what in (
            ("padding-read", leaked, "rows non-finite with NaN padding, finite with zeros"),
            ("nonfinite", clean_bad, "rows non-finite with zero padding"),
        ):
            message = _rows_message(rows, what)
            if message and check in checks:
                findings.append(Finding(check, message))
                reported = {g: reported[g] | rows[g] for g in GRADIENTS}
    result = expected.translate(last)
    nonzero = {
        g: outside_tolerance(getattr(result, g), 0.0, 0.0).any(axis=-1)
        & expected.zero[g]
        & ~reported[g]
        for g in GRADIENTS
    }
    what = "rows nonzero where the convention has zero (empty rows, keys no query sees, padding)"
    message = _rows_message(nonzero, what)
    if message:
        findings.append(Finding("zero-grad", message))
    return findings, result, unwritten, clean


def _excuse_overflow(
    findings: list[Finding],
    clean: Gradients,
    expected: _Expected,
    reference: Gradients,
    bounds: Any,
) -> tuple[list[Finding], tuple[str, ...]]:
    """The ``nonfinite`` finding without the rows whose non-finite values the declared chain
    allows against the float64 ``reference`` (:func:`reference.compare.outside_tolerance`):
    +-inf where its bound is inf (the output past its largest finite value), anything where a
    16-bit dS may overflow (``*_undefined``); and a note counting the rows excused."""
    remaining, excused = {}, {}
    for g in GRADIENTS:
        values, bound, ref = (np.asarray(getattr(x, g)) for x in (clean, bounds, reference))
        overflow = np.isinf(bound)
        bad = ~np.isfinite(values) & expected.must_write[g][..., None]
        compared = bad & ~np.isnan(ref)  # a NaN reference excuses nothing
        refused = outside_tolerance(
            values, ref, bound, where=compared, inf_ok=overflow,
            nan_ok=overflow & getattr(bounds, f"{g}_undefined"), name=f"{g} bound",
        )  # fmt: skip
        remaining[g] = ((bad & ~compared) | refused).any(axis=-1)
        excused[g] = bad.any(axis=-1) & ~remaining[g]
    if not any(rows.any() for rows in excused.values()):
        return findings, ()
    kept = [f for f in findings if f.check != "nonfinite"]
    message = _rows_message(remaining, "rows non-finite with zero padding")
    if message:
        kept.append(Finding("nonfinite", message))
    counts = ", ".join(f"{g} {int(excused[g].sum())}" for g in GRADIENTS if excused[g].any())
    return kept, (f"rows overflowing to inf where the declared chain may overflow: {counts}",)


def _rows_message(rows: dict[str, np.ndarray], what: str) -> str:
    """``"dq: n of N <what>; first at (b, i, h)"`` per gradient with any row set; "" if none."""
    parts = []
    for g in GRADIENTS:
        if rows[g].any():
            b, i, h = (int(x) for x in np.argwhere(rows[g])[0])
            where = f"(b={b}, {'i' if g == 'dq' else 'j'}={i}, h={h})"
            parts.append(f"{g}: {int(rows[g].sum())} of {rows[g].size} {what}; first at {where}")
    return "; ".join(parts)


def _bits(values: np.ndarray) -> np.ndarray:
    """float64 bit patterns (exact and injective from fp16/bf16/fp32, as the forward's)."""
    return np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)


def _differ(runs: list[tuple[Gradients, tuple[str, ...]]], expected: _Expected) -> dict:
    """Per gradient, elements (on rows the kernel must write) whose bits differ between the
    first run and any later one."""
    first = runs[0][0]
    differ = {}
    for g in GRADIENTS:
        a = getattr(first, g)
        where = expected.must_write[g][..., None]
        differ[g] = np.zeros(a.shape, dtype=bool)
        for other, _ in runs[1:]:
            differ[g] |= (_bits(a) != _bits(getattr(other, g))) & where
    return differ


def _run_to_run(
    spec: KernelSpec,
    runs: list[tuple[Gradients, tuple[str, ...]]],
    expected: _Expected,
    unwritten: dict[str, np.ndarray],
) -> RunToRun:
    """The bitwise comparison of the runs (rows reported unwritten left out)."""
    differ = _differ(runs, expected)
    count, largest = 0, 0.0
    for g in GRADIENTS:
        differ[g] &= ~unwritten[g][..., None]
        count += int(differ[g].sum())
        if differ[g].any():
            values = [getattr(result, g)[differ[g]] for result, _ in runs]
            with np.errstate(invalid="ignore"):
                spread = np.nanmax(values, axis=0) - np.nanmin(values, axis=0)
            largest = max(largest, float(np.nanmax(spread, initial=0.0)))
    return RunToRun(len(runs), bool(spec.backward_deterministic), count, largest)


def _determinism_message(runs: list[tuple[Gradients, tuple[str, ...]]], expected: _Expected) -> str:
    parts = []
    for g, differ in _differ(runs, expected).items():
        if differ.any():
            index = tuple(int(x) for x in np.argwhere(differ)[0])
            a, b = getattr(runs[0][0], g)[index], getattr(runs[-1][0], g)[index]
            parts.append(
                f"{g}: {int(differ.sum())} elements differ bitwise between runs; first at "
                f"{index}: {float(a)!r} vs {float(b)!r}"
            )
    return "; ".join(parts) + " (spec.backward_deterministic is True)"


def bound_findings(
    refs: BackwardReferences, spec: KernelSpec, results: list[Gradients]
) -> list[Finding]:
    """``dq-bound`` / ``dk-bound`` / ``dv-bound``: each result against float64 (every element)
    and exact (samples) with the declared chain's derived bounds, with the triage."""
    findings = []
    # One comparison per result and tier covers the three gradients.
    compared = [
        {t: r for t in ("float64", "exact") if (r := refs.compare(result, t, spec)) is not None}
        for result in results
    ]
    for g in GRADIENTS:
        for result, by_tier in zip(results, compared, strict=True):
            reports = {t: r[g] for t, r in by_tier.items()}
            if any(r.mismatched for r in reports.values()):
                findings.append(Finding(f"{g}-bound", _triage(refs, spec, result, g, reports)))
                break
    return findings


def triage(refs: BackwardReferences, spec: KernelSpec, result: Gradients) -> dict[str, str]:
    """Per gradient, which tier disagrees: "kernel" (the kernel is off, the emulation within:
    an implementation bug), "chain" (the emulation of the declared chain is off too: precision
    chain or bound) or "none" (everything within: the error is what the chain costs). Off means
    outside the bound against float64 (every element) or exact (samples)."""
    precision = spec.backward_precision_for(refs.case.forward.dtype)
    emulation = refs.streaming(precision, spec.tile_m, spec.tile_n)

    def off(tested: Gradients) -> dict[str, bool]:
        reports = [refs.compare(tested, tier, spec) for tier in ("float64", "exact")]
        return {g: any(r[g].mismatched for r in reports if r is not None) for g in GRADIENTS}

    kernel, chain = off(result), off(emulation)
    return {g: "chain" if chain[g] else ("kernel" if kernel[g] else "none") for g in GRADIENTS}


def _triage(
    refs: BackwardReferences, spec: KernelSpec, result: Gradients, g: str, reports: dict
) -> str:
    """The three-tier triage of one gradient's bound failure, as text."""
    lines = [f"kernel vs {tier}: {report.summary()}" for tier, report in reports.items()]
    scale = KERNEL_VS_STREAMING_SCALE
    versus = refs.compare(result, "streaming", spec, scale=scale)[g]
    lines.append(
        f"kernel vs streaming emulation: {'within' if not versus.mismatched else 'OUTSIDE'} "
        f"{scale:g}x the bound"
    )
    verdict = triage(refs, spec, result)[g]
    lines.append(
        "triage: "
        + (
            "emulation fails too -> precision chain or bound"
            if verdict == "chain"
            else "emulation agrees with the references -> kernel implementation bug"
        )
    )
    return "\n  ".join(lines)
