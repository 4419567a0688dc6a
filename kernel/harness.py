"""Defensive runner: a kernel's bugs show up as named findings, never as a dead test session.

For each case the kernel runs twice on a *poisoned* copy (NaN in every padding position the
case model lets a kernel never read; adapters add NaN guard bands around device inputs):

* run A with outputs prefilled with NaN, run B prefilled with zero (adapters that expose
  ``run_guarded(case, prefill=...)``; others allocate their own outputs);
* a third run on the clean case only when B holds unexpected non-finite values.

Checks (``CHECKS``), each applied where the adapter's ``checks`` says it can be:
``error`` / ``crash`` / ``timeout`` (isolated worker; the case is saved as .npz and a fresh
worker continues), ``output-guard`` (a guard band around ``o``/``lse`` changed), ``unwritten``
(the NaN prefill survives where the kernel must write), ``padding-read`` (non-finite only when
padding holds NaN), ``nonfinite`` (non-finite on clean inputs), ``determinism`` (A and B differ
bitwise), ``empty-rows`` (empty rows differ from the declared convention), ``bound`` / ``lse``
(O / LSE outside the derived error bound, against float64 on all rows and exact on sampled rows).
Declared convention differences (``spec.empty_rows``, ``spec.padded_rows``) are checked and
translated to the project convention, and listed in ``Verdict.declared``, never failed.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernel.spec import KernelAdapter, KernelSpec
from reference.case import AttentionCase, AttentionResult
from reference.masks import empty_rows

CHECKS = (
    "error",
    "crash",
    "timeout",
    "output-guard",
    "unwritten",
    "padding-read",
    "nonfinite",
    "determinism",
    "empty-rows",
    "bound",
    "lse",
)
_BASIC_CHECKS = frozenset({"determinism", "nonfinite"})


class Declined(Exception):
    """Raised by an adapter whose kernel refuses a case its spec cannot rule out (e.g. an SDPA
    backend with "No available kernel"); the verdict is then skipped with this reason."""


class CheckFailed(AssertionError):
    """Raised by :meth:`Verdict.raise_for`; the message starts with the check's name."""


@dataclass(frozen=True)
class Finding:
    """One failed check, with the saved case that triggered it (when a directory was given)."""

    check: str
    message: str
    case_path: str | None = None

    def __str__(self) -> str:
        where = f" (case saved: {self.case_path})" if self.case_path else ""
        return f"{self.check}: {self.message}{where}"


@dataclass(frozen=True)
class Verdict:
    """Outcome of one kernel on one case: findings per check, declared differences, result."""

    kernel: str
    case: str
    findings: tuple[Finding, ...] = ()
    skipped: str | None = None
    applied: frozenset[str] = frozenset()
    declared: tuple[str, ...] = ()
    result: AttentionResult | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.findings

    def failed(self, check: str) -> bool:
        return any(f.check == check for f in self.findings)

    def raise_for(self, *checks: str) -> None:
        """Raise :class:`CheckFailed` for the first finding of ``checks`` (all when empty)."""
        __tracebackhide__ = True
        for finding in self.findings:
            if not checks or finding.check in checks:
                raise CheckFailed(f"{finding}\n  kernel {self.kernel}, case {self.case}")


def fill_padding(case: AttentionCase, value: float) -> AttentionCase:
    """A copy of ``case`` with ``value`` in q rows past ``q_lengths`` and k/v rows past
    ``k_lengths``: NaN poisons padding (reads show), 0 cleans it (for the triage run)."""
    arrays = {}
    lengths = {"q": case.mask.q_lengths, "k": case.mask.k_lengths, "v": case.mask.k_lengths}
    for name, valid in lengths.items():
        array = np.array(getattr(case, name))
        if valid is not None:
            pad = np.arange(array.shape[1])[None, :] >= np.asarray(valid)[:, None]
            array[pad] = value
        arrays[name] = array
    return AttentionCase(
        **arrays, softmax_scale=case.softmax_scale, mask=case.mask, label=case.label
    )


def applied_checks(adapter: KernelAdapter) -> frozenset[str]:
    """The defensive checks this adapter supports (``adapter.checks``, else the basic ones)."""
    return frozenset(getattr(adapter, "checks", _BASIC_CHECKS))


def execute(
    adapter: KernelAdapter, case: AttentionCase, prefill: str
) -> tuple[AttentionResult, tuple[str, ...]]:
    """One call: through ``run_guarded`` when the adapter has it, else ``adapter(case)``."""
    if hasattr(adapter, "run_guarded"):
        result, writes = adapter.run_guarded(case, prefill=prefill)
        return result, tuple(writes)
    return adapter(case), ()


# ---------------------------------------------------------------- isolation (worker process)


def _worker_main(kernel: str, conn: Any) -> None:
    """Worker loop: resolve the kernel once, then answer ("run", case, prefill) messages."""
    from kernel.registry import resolve

    adapter = resolve(kernel)
    while True:
        message = conn.recv()
        if message is None:
            return
        _, case, prefill = message
        try:
            result, writes = execute(adapter, case, prefill)
            conn.send(("ok", result.o, result.lse, writes))
        except Declined as declined:
            conn.send(("declined", str(declined), ""))
        except Exception as error:  # noqa: BLE001 - any kernel error is a finding, reported back
            conn.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc(limit=4)))


class _KernelCrashed(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


@dataclass
class IsolatedKernel:
    """A kernel living in a spawned worker process; restarted after a crash, hang or CUDA error."""

    kernel: str
    timeout_s: float = 300.0
    _process: Any = field(default=None, repr=False)
    _conn: Any = field(default=None, repr=False)

    def call(self, case: AttentionCase, prefill: str) -> tuple[AttentionResult, tuple[str, ...]]:
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._conn.send(("run", case, prefill))
            if not self._conn.poll(self.timeout_s):
                self.close(kill=True)
                raise _KernelCrashed(
                    "timeout", f"no answer within {self.timeout_s:g} s (hang); worker killed"
                )
            reply = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.close(kill=True)
            raise _KernelCrashed("crash", f"worker process died (exit code {code})") from None
        if reply[0] == "declined":
            raise Declined(reply[1])
        if reply[0] == "error":
            if any(
                word in reply[1].lower() for word in ("cuda", "illegal", "device-side", "launch")
            ):
                self.close(kill=True)  # the CUDA context may be corrupt: next call gets a fresh one
            raise _KernelCrashed("error", f"{reply[1]}\n{reply[2]}")
        _, o, lse, writes = reply
        return AttentionResult(o=o, lse=lse), writes

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_worker_main, args=(self.kernel, child), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    def close(self, *, kill: bool = False) -> None:
        if self._process is None:
            return
        if not kill and self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()
        self._process = self._conn = None


# ---------------------------------------------------------------- the runner


def run_case(
    adapter: KernelAdapter,
    case: AttentionCase,
    *,
    isolated: IsolatedKernel | None = None,
    repeats: int = 2,
    compare: bool = True,
    exact_rows: int = 4,
    finding_dir: str | Path | None = None,
) -> Verdict:
    """Run ``adapter`` on ``case`` under every applicable check and return the verdict.

    ``isolated`` runs the calls in that worker (``adapter`` then only supplies ``spec`` and
    ``checks``); without it the calls run in this process. ``repeats`` >= 2 runs give the
    determinism check. ``compare`` adds the reference checks (``bound``, ``lse``).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    spec = adapter.spec
    start = time.perf_counter()
    reason = spec.unsupported(case)
    if reason is not None:
        return Verdict(spec.name, case.describe(), skipped=reason)
    checks = applied_checks(adapter)
    poisoned = fill_padding(case, np.nan) if "padding-poison" in checks else case
    clean = fill_padding(case, 0.0)

    def call(which: AttentionCase, prefill: str) -> tuple[AttentionResult, tuple[str, ...]]:
        return (
            isolated.call(which, prefill)
            if isolated is not None
            else execute(adapter, which, prefill)
        )

    try:
        runs = [call(poisoned, "nan" if i == 0 else "zero") for i in range(repeats)]
        findings, declared, result = _analyse(
            spec, checks, case, runs, lambda: call(clean, "zero")[0]
        )
    except _KernelCrashed as crash:
        findings, declared, result = [Finding(crash.check, str(crash))], [], None
    except Declined as declined:
        return Verdict(spec.name, case.describe(), skipped=f"declined by the kernel: {declined}")
    if (
        compare
        and result is not None
        and not any(f.check in ("unwritten", "nonfinite", "padding-read") for f in findings)
    ):
        findings += reference_findings(case, result, spec, exact_rows=exact_rows)
    if findings and finding_dir is not None:
        path = _save(case, spec.name, findings[0].check, finding_dir)
        findings = [Finding(f.check, f.message, str(path)) for f in findings]
    return Verdict(
        spec.name,
        case.describe(),
        tuple(findings),
        applied=checks | ({"bound", "lse"} if compare else set()),
        declared=tuple(declared),
        result=result,
        seconds=time.perf_counter() - start,
    )


def _save(case: AttentionCase, kernel: str, check: str, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest = abs(hash((case.describe(), case.q.tobytes()[:4096]))) % 10**8
    return case.save(directory / f"{kernel}-{check}-{digest:08d}.npz")


def _analyse(
    spec: KernelSpec,
    checks: frozenset[str],
    case: AttentionCase,
    runs: list[tuple[AttentionResult, tuple[str, ...]]],
    clean_run: Any,
) -> tuple[list[Finding], list[str], AttentionResult]:
    """Turn the raw runs into findings; returns the (translated) result of the last run."""
    findings: list[Finding] = []
    declared: list[str] = []
    writes = sorted({w for _, run_writes in runs for w in run_writes})
    if writes and "output-guard" in checks:
        findings.append(Finding("output-guard", "; ".join(writes)))
    first, last = runs[0][0], runs[-1][0]
    empty = empty_rows(case).transpose(0, 2, 1)  # [B, Sq, Hq]
    padded = np.zeros_like(empty)
    for b in range(case.B):
        padded[b, case.q_length(b) :] = True
    must_write = ~padded if spec.padded_rows == "unwritten" else np.ones_like(empty)
    must_be_finite = must_write & ~(empty & (spec.empty_rows == "nan"))

    def bad_rows(result: AttentionResult) -> np.ndarray:
        bad = ~np.isfinite(result.o).all(axis=-1)
        if result.lse is not None:
            lse = result.lse.transpose(0, 2, 1)
            bad |= np.isnan(lse) | (np.isinf(lse) & ~empty)
        return bad & must_be_finite

    if "prefill" in checks and len(runs) > 1 and bad_rows(first).any():
        unwritten = bad_rows(first) & ~bad_rows(last)
        if unwritten.any():
            findings.append(
                Finding(
                    "unwritten",
                    _rows_message(unwritten, "rows kept the NaN prefill (never written)"),
                )
            )
    if bad_rows(last).any():
        clean_bad = bad_rows(clean_run())
        leaked = bad_rows(last) & ~clean_bad
        if leaked.any():
            findings.append(
                Finding(
                    "padding-read",
                    _rows_message(
                        leaked, "rows non-finite with NaN padding but finite with zero padding"
                    ),
                )
            )
        if clean_bad.any():
            findings.append(
                Finding(
                    "nonfinite",
                    _rows_message(
                        clean_bad,
                        "rows non-finite with zero padding (NaN only in input guard bands, if any)",
                    ),
                )
            )
    if spec.deterministic and len(runs) > 1:
        for name in ("o", "lse"):
            a, b = getattr(first, name), getattr(last, name)
            if a is None or b is None:
                continue
            both = np.isfinite(a) & np.isfinite(b)
            differ = (both & (a != b)) | (np.isfinite(a) & ~np.isfinite(b))
            if differ.any():
                findings.append(
                    Finding(
                        "determinism",
                        f"{name}: {int(differ.sum())} elements differ bitwise between two runs",
                    )
                )
    result, notes, empty_findings = _translate(spec, last, empty, padded, bad_rows(last))
    declared += notes
    findings += empty_findings
    return findings, declared, result


def _rows_message(rows: np.ndarray, what: str) -> str:
    b, i, h = (int(x) for x in np.argwhere(rows)[0])
    return f"{int(rows.sum())} of {rows.size} {what}; first at (b={b}, i={i}, h={h})"


def _translate(
    spec: KernelSpec,
    result: AttentionResult,
    empty: np.ndarray,
    padded: np.ndarray,
    already_bad: np.ndarray,
) -> tuple[AttentionResult, list[str], list[Finding]]:
    """Check empty rows against the declaration (rows in ``already_bad`` are reported
    elsewhere) and rewrite empty and padded rows as O = 0, LSE = -inf."""
    o = np.array(result.o)
    lse = None if result.lse is None else np.array(result.lse)
    notes: list[str] = []
    findings: list[Finding] = []
    valid_empty = empty & ~padded & ~already_bad
    if valid_empty.any():
        rows_o = o[valid_empty]
        allowed = np.isnan(rows_o) | (rows_o == 0) if spec.empty_rows == "nan" else rows_o == 0
        wrong = ~allowed.all(axis=-1)
        if lse is not None:
            wrong |= ~np.isneginf(lse.transpose(0, 2, 1)[valid_empty])
        if wrong.any():
            findings.append(
                Finding(
                    "empty-rows",
                    f"{int(wrong.sum())} empty rows not O = 0 / LSE = -inf "
                    f"(declared {spec.empty_rows!r})",
                )
            )
        if spec.empty_rows == "nan" and np.isnan(rows_o).any():
            count = int(np.isnan(rows_o).any(axis=-1).sum())
            notes.append(f"{count} empty rows gave NaN (declared; read as O = 0)")
    if spec.padded_rows == "unwritten" and padded.any():
        notes.append(f"{int(padded.sum())} padded query rows not written (declared; read as O = 0)")
    o[empty] = 0.0
    if lse is not None:
        lse.transpose(0, 2, 1)[empty] = -np.inf
    return AttentionResult(o=o, lse=lse), notes, findings


# ---------------------------------------------------------------- references


def float64_reference(case: AttentionCase, spec: KernelSpec) -> AttentionResult:
    """float64 attention on every row: torch on the GPU for large GPU cases, else the streaming
    tier in float64 (automatic by size)."""
    work = case.B * case.Hq * case.Sq * case.Sk * (case.D + case.Dv)
    if spec.device == "cuda" and work > 1 << 24 and _cuda_available():
        from kernel.adapters._torch import float64_reference as torch_reference

        return torch_reference(case)
    from reference.precision import StreamingPrecision
    from reference.streaming import streaming_attention

    return streaming_attention(
        case, StreamingPrecision.float64(), block_m=spec.tile_m, block_n=spec.tile_n
    )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def reference_findings(
    case: AttentionCase, result: AttentionResult, spec: KernelSpec, *, exact_rows: int = 4
) -> list[Finding]:
    """``bound`` / ``lse`` findings: the kernel against float64 (all rows) and exact (sampled
    rows), with the derived bounds of the declared precision chain; a ``bound`` message carries
    the triage (kernel vs streaming emulation, emulation vs exact)."""
    from reference.bounds import error_bound, lse_error_bound
    from reference.compare import compare
    from reference.exact import exact_attention, sample_rows

    precision = spec.precision_for(case.dtype)
    reference = float64_reference(case, spec)
    bound = error_bound(case, reference, precision, block_n=spec.tile_n)
    lse_bound = None
    if result.lse is not None:
        lse_bound = lse_error_bound(case, reference, precision, block_n=spec.tile_n)
    report = compare(result, reference, bound=bound, output_dtype=case.dtype, lse_bound=lse_bound)
    exact = exact_attention(case, rows=sample_rows(case, exact_rows)) if exact_rows else None
    exact_report = None
    if exact is not None:
        exact_report = compare(
            result,
            exact,
            bound=bound,
            output_dtype=case.dtype,
            rows=exact.rows,
            lse_bound=lse_bound,
        )
    reports = [r for r in (report, exact_report) if r is not None]
    findings = []
    if any(r.mismatched for r in reports):
        findings.append(
            Finding("bound", _triage(case, spec, result, report, exact_report, exact, bound))
        )
    if any(r.lse_mismatched for r in reports):
        summary = "; ".join(
            f"{r.lse_mismatched} LSE values outside the bound, max |err| {r.lse_max_abs:.3g}"
            for r in reports
            if r.lse_mismatched
        )
        findings.append(Finding("lse", f"{summary} (vs float64 / exact sampled rows)"))
    return findings


def _triage(
    case: AttentionCase,
    spec: KernelSpec,
    result: AttentionResult,
    report: Any,
    exact_report: Any,
    exact: Any,
    bound: np.ndarray,
) -> str:
    """The three-tier triage of a ``bound`` failure, as text for the finding."""
    from reference.compare import compare
    from reference.streaming import streaming_attention

    precision = spec.precision_for(case.dtype)
    emulation = streaming_attention(case, precision, block_m=spec.tile_m, block_n=spec.tile_n)
    lines = [f"kernel vs float64 (all rows): {report.summary()}"]
    if exact_report is not None:
        lines.append(f"kernel vs exact (sampled rows): {exact_report.summary()}")
    kernel_emu = compare(result, emulation, bound=bound, output_dtype=case.dtype)
    lines.append(
        f"kernel vs streaming emulation: {'within' if kernel_emu.passed else 'OUTSIDE'} the bound"
    )
    emu_ok = True
    if exact is not None:
        emu_exact = compare(emulation, exact, bound=bound, output_dtype=case.dtype, rows=exact.rows)
        emu_ok = emu_exact.passed
        lines.append(f"streaming emulation vs exact: {'within' if emu_ok else 'OUTSIDE'} the bound")
    lines.append(
        "triage: "
        + (
            "emulation agrees with exact -> kernel implementation bug"
            if emu_ok
            else "emulation fails too -> precision chain or bound"
        )
    )
    return "\n  ".join(lines)
