"""References at GPU sizes: float64 on all rows or exact on sampled rows, chosen by size.

One :class:`CaseReferences` per case holds every reference tier, computed lazily and once, so
the harness (:func:`kernel.harness.forward.reference_findings`) and the report
(:mod:`report.runner`) compare kernels the same way:

* ``float64``: float64 attention on every row: chunked torch on the GPU for large cases when
  the kernel lives there (:mod:`reference.rowwise`), else the streaming tier in float64; above
  ``dense_limit`` multiply-adds (a *long* case, docs/long-context.md) only on an adversarial
  row plan (:mod:`reference.sampling`) plus the rows where the kernel looks worst
  (:meth:`CaseReferences.focus`), NaN elsewhere (:mod:`reference.subset`);
* ``exact``: the exact tier (:mod:`reference.exact`) on ``rows`` sampled query rows (inside the
  plan for a long case);
* ``streaming``: the emulation of a declared precision chain and tile sizes, with its trace;
* the derived bounds (``reference.bounds``) of a precision chain, from the float64 result.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.phases import in_phase, phase
from attention_crossval.kernel.harness.verdict import Finding, chain_hint
from attention_crossval.reference.bounds import forward_error_bounds
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.compare import compare
from attention_crossval.reference.exact import ExactResult, exact_attention, sample_rows
from attention_crossval.reference.parallel import map_heads
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.rowwise import row_scores, rowwise_attention
from attention_crossval.reference.sampling import adversarial_plan, exact_rows, worst_positions
from attention_crossval.reference.splitkv import splitkv_attention
from attention_crossval.reference.streaming import RescaleTrace, streaming_attention
from attention_crossval.reference.subset import RowSubset

# Kernel and streaming tier are each within the bound of the exact value, so their difference is
# within twice the bound: the tolerance of a pair of two bounded results.
PAIR_BOUND_SCALE = {"kernel_vs_exact": 1.0, "kernel_vs_streaming": 2.0, "streaming_vs_exact": 1.0}
TORCH_WORK = 1 << 24  # above this many multiply-adds a CUDA kernel's float64 reference uses torch
# Above this many multiply-adds a case is long: references on a row plan (docs/long-context.md)
DENSE_LIMIT = 1 << 31
# From this many keys the CPU tiers run in forked workers, by units of heads (reference.parallel)
PARALLEL_KEYS = 1 << 15


def work(case: AttentionCase) -> int:
    """Multiply-adds of dense attention on ``case``: what decides the reference strategy."""
    return case.B * case.Hq * case.Sq * case.Sk * (case.D + case.Dv)


def output_dtype(spec: KernelSpec, dtype: str) -> str:
    """The dtype whose spacing measures a kernel's ulps: its declared chain's ``output_dtype``,
    else the chain's ``accum_dtype``. ``output_dtype=None`` means the chain returns the
    accumulator's values (StreamingPrecision), so those are the values the kernel writes;
    falling back to the input dtype would count ulps of a format the output is not rounded to.
    """
    precision = spec.precision_for(dtype)
    return precision.output_dtype or precision.accum_dtype


@dataclass
class CaseReferences:
    """Every reference tier of one case, computed lazily and shared by the kernels checked on it.

    ``rows``: query rows sampled for the exact tier (0: no exact tier); ``dense_limit``: above
    that many multiply-adds the case is *long*: the float64/streaming results and the bounds
    cover an adversarial row plan (:mod:`reference.sampling`, about ``subset_rows`` rows over
    all batches and heads, the query tiles ``tile_m`` / ``tile_n`` a kernel declares) with the
    exact rows inside it, and :meth:`focus` adds the rows where a kernel looks worst (None:
    always every row); the exact tier takes at most ``exact_keys // Sk`` of ``rows`` (at least
    2: its cost is rows times keys); ``device``: where the kernel
    runs ("cuda" lets the float64 reference and the scan use torch on the GPU);
    ``exact_source(case, rows, prec_bits)`` replaces the direct exact computation (e.g. an
    on-disk cache). ``timings`` accumulates seconds per phase (``sample_s``, ``scan_s``,
    ``float64_s``, ``streaming_s``, ``bound_s``, ``exact_s``).
    """

    case: AttentionCase
    rows: int = 4
    row_seed: int = 0
    prec_bits: int = 128
    dense_limit: int | None = DENSE_LIMIT
    subset_rows: int = 256
    device: str = "cpu"
    exact_source: Callable[[AttentionCase, np.ndarray, int], Any] | None = None
    tile_m: int = 128
    tile_n: int = 128
    exact_keys: int = 1 << 20
    worst: tuple[int, ...] = ()
    scores: np.ndarray | None = field(default=None, repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False)

    def _timed(self, key: Any, label: str, compute: Callable[[], Any]) -> Any:
        return timed_memo(self._memo, self.timings, key, label, compute)

    @property
    def long(self) -> bool:
        """Above ``dense_limit``: references on a row plan, never on every row."""
        return self.dense_limit is not None and work(self.case) > self.dense_limit

    def plan(self) -> Any:
        """The long case's ``reference.sampling.RowPlan`` (with the :meth:`focus` rows)."""

        def compute() -> Any:
            case = self.case
            budget = max(1, self.subset_rows // max(case.B * case.Hq, 1))
            plan = adversarial_plan(
                case, tile_m=self.tile_m, tile_n=self.tile_n, budget=budget, seed=self.row_seed
            )
            return plan.with_reason("worst", np.array(self.worst, dtype=np.int64))

        return self._timed("plan", "sample_s", compute)

    def sampled_rows(self) -> np.ndarray | None:
        """Bool ``[B, Hq, Sq]`` of the exact tier's rows (None without an exact tier)."""
        if self.rows < 1:
            return None

        def compute() -> np.ndarray:
            count = min(self.rows, max(2, self.exact_keys // max(self.case.Sk, 1)))
            if not self.long:
                return sample_rows(self.case, count, self.row_seed)
            return exact_rows(self.case, self.plan(), count, seed=self.row_seed, scores=self.scores)

        return self._timed("rows", "sample_s", compute)

    def exact(self) -> Any:
        """The exact tier on :meth:`sampled_rows` (an ``ExactResult``), or None."""
        rows = self.sampled_rows()
        if rows is None:
            return None

        def compute() -> Any:
            if self.long or self.case.Sk >= PARALLEL_KEYS:
                return self._exact_per_head(rows)
            if self.exact_source is not None:
                return self.exact_source(self.case, rows, self.prec_bits)
            return exact_attention(self.case, rows=rows, prec_bits=self.prec_bits)

        return self._timed("exact", "exact_s", compute)

    def _exact_per_head(self, rows: np.ndarray) -> Any:
        """The exact tier of a long case, each (batch, head) with sampled rows in a worker,
        only those rows coming back (no disk cache: an entry would hold full-size arrays)."""

        case, prec_bits = self.case, self.prec_bits
        heads = [(int(b), int(h)) for b, h in zip(*np.nonzero(rows.any(axis=2)), strict=True)]

        def unit(sub: AttentionCase, b: int, hs: tuple[int, ...]) -> list[tuple]:
            picked = rows[b : b + 1, hs[0] : hs[-1] + 1]
            result = exact_attention(sub, rows=picked, prec_bits=prec_bits)
            found = []
            for j in range(len(hs)):
                i = np.flatnonzero(picked[0, j])
                per_row = (result.lse, result.o_err_bound, result.lse_err_bound)
                o_parts = (result.o[0, i, j], result.o_lo[0, i, j])
                found.append((i, o_parts, tuple(x[0, j, i] for x in per_row)))
            return found

        o, o_lo = (np.full((case.B, case.Sq, case.Hq, case.Dv), np.nan) for _ in "oo")
        lse, o_err, lse_err = (np.full((case.B, case.Hq, case.Sq), np.nan) for _ in "lol")
        for (b, h), (i, (o_part, lo_part), per_row) in zip(
            heads, map_heads(case, unit, heads), strict=True
        ):
            o[b, i, h], o_lo[b, i, h] = o_part, lo_part
            lse[b, h, i], o_err[b, h, i], lse_err[b, h, i] = per_row
        return ExactResult(o, o_lo, lse, o_err, lse_err, rows=rows.copy(), prec_bits=prec_bits)

    def focus(self, result: AttentionResult) -> CaseReferences:
        """For a long case, these references plus the rows where ``result`` (a kernel's full
        output) looks worst against float32 attention on every row
        (``reference.rowwise.row_scores``, on the GPU for a CUDA kernel): new memo, same
        timings. A short case is returned as it is (every row is evaluated anyway)."""
        if not self.long:
            return self

        def compute() -> np.ndarray:
            return row_scores(self.case, result, dtype="float32", **_backend(self.device))

        scores = timed_memo({}, self.timings, "scan", "scan_s", compute)
        budget = max(1, self.subset_rows // max(self.case.B * self.case.Hq, 1))
        worst = worst_positions(scores, max(2, budget // 4))
        return dataclasses.replace(
            self, worst=tuple(int(i) for i in worst), scores=scores, _memo={}
        )

    def subset(self) -> Any:
        """The evaluated ``reference.subset.RowSubset``, or None when every row is evaluated."""
        if not self.long:
            return None

        def compute() -> Any:
            sampled = self.sampled_rows()
            extra = [] if sampled is None else np.flatnonzero(sampled.any(axis=(0, 1)))
            return RowSubset.of(self.case, np.concatenate([self.plan().positions, extra]))

        return self._timed("subset", "sample_s", compute)

    def evaluated_rows(self) -> np.ndarray | None:
        """Bool ``[B, Hq, Sq]`` of the rows the float64/streaming results cover (None: all)."""
        subset = self.subset()
        return None if subset is None else subset.row_mask()

    def _evaluated_case(self) -> AttentionCase:
        subset = self.subset()
        return self.case if subset is None else subset.case

    def _on_rows(self, result: AttentionResult) -> AttentionResult:
        subset = self.subset()
        return result if subset is None else subset.scatter(result)

    def _float64_evaluated(self) -> AttentionResult:
        def compute() -> AttentionResult:
            subset = self.subset()
            if subset is None:
                return float64_reference(self.case, self.device)
            # on the full case's own mask (row intervals), at the subset's positions: the same
            # rows as the sub-case, without its explicit mask
            return rowwise_attention(self.case, subset.positions, **_backend(self.device))

        return self._timed("float64", "float64_s", compute)

    def float64(self) -> AttentionResult:
        """float64 result, full shape (NaN on rows not evaluated)."""
        return self._on_rows(self._float64_evaluated())

    def streaming(self, precision: StreamingPrecision, tile_m: int, tile_n: int):
        """The emulated result and a ``(b, h, i) -> (rescales, visible blocks)`` trace reader;
        split over the case's ``num_splits`` and combined as a split-KV kernel does."""

        def unit(case: AttentionCase, b: int, hs: tuple[int, ...]) -> list[tuple]:
            trace = RescaleTrace()
            blocks = dict(block_m=tile_m, block_n=tile_n, trace=trace)
            result = (
                streaming_attention(case, precision, **blocks)
                if case.num_splits == 1
                else splitkv_attention(case, precision, num_splits=case.num_splits, **blocks)
            )
            return [
                (
                    result.o[0, :, j],
                    result.lse[0, j],
                    trace.rescales[0, j],
                    trace.visible_blocks[0, j],
                )
                for j in range(len(hs))
            ]

        def compute():
            case = self._evaluated_case()
            o = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
            lse = np.zeros((case.B, case.Hq, case.Sq))
            rescales, blocks = (np.zeros((case.B, case.Hq, case.Sq), np.int64) for _ in "rb")
            for (b, h), parts in self._per_head(case, unit):
                o[b, :, h], lse[b, h], rescales[b, h], blocks[b, h] = parts
            subset = self.subset()
            index = (lambda i: i) if subset is None else subset.index
            result = self._on_rows(AttentionResult(o=o, lse=lse))
            return result, lambda b, h, i: (
                int(rescales[b, h, index(i)]),
                int(blocks[b, h, index(i)]),
            )

        return self._timed(("streaming", precision, tile_m, tile_n), "streaming_s", compute)

    def bounds(
        self, precision: StreamingPrecision, tile_n: int, *, tanh_error_ulp: float = 2.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Derived bounds on O ``[B, Sq, Hq, Dv]`` and on the LSE ``[B, Hq, Sq]`` (NaN on rows
        not evaluated), as derived in docs/numerics.md#error-bound, with the case's
        ``num_splits`` and the kernel's tanh error (``KernelSpec.tanh_error_ulp``)."""

        def compute():
            case, reference = self._evaluated_case(), self._float64_evaluated()
            options = dict(
                block_n=tile_n, tanh_error_ulp=tanh_error_ulp, num_splits=case.num_splits
            )

            def unit(sub: AttentionCase, b: int, hs: tuple[int, ...]) -> list[tuple]:
                heads = slice(hs[0], hs[-1] + 1)
                ref = AttentionResult(
                    o=reference.o[b : b + 1, :, heads], lse=reference.lse[b : b + 1, heads]
                )
                bound, lse_bound = forward_error_bounds(sub, ref, precision, **options)
                return [(bound[0, :, j], lse_bound[0, j]) for j in range(len(hs))]

            bound = np.zeros((case.B, case.Sq, case.Hq, case.Dv))
            lse_bound = np.zeros((case.B, case.Hq, case.Sq))
            for (b, h), (o_part, lse_part) in self._per_head(case, unit):
                bound[b, :, h], lse_bound[b, h] = o_part, lse_part
            subset = self.subset()
            if subset is None:
                return bound, lse_bound
            return subset.scatter_o(bound), subset.scatter_rows(lse_bound)

        return self._timed(("bound", precision, tile_n, tanh_error_ulp), "bound_s", compute)

    def _per_head(self, case: AttentionCase, function: Callable) -> list[tuple[tuple, Any]]:
        """``((b, h), result)`` for every batch and query head of ``case``, ``function(unit
        case, b, heads)`` giving the results of a unit's heads (``reference.parallel``):
        forked workers for a long case or one of at least :data:`PARALLEL_KEYS` keys, else
        every unit here."""
        heads = [(b, h) for b in range(case.B) for h in range(case.Hq)]
        workers = None if self.long or case.Sk >= PARALLEL_KEYS else 1
        return list(zip(heads, map_heads(case, function, heads, workers=workers), strict=True))

    @in_phase("compare")
    def compare(
        self, tested: AttentionResult, tier: str, spec: KernelSpec, *, scale: float = 1.0
    ) -> Any:
        """``reference.compare.compare`` of ``tested`` against ``tier`` ("exact", "float64" or
        "streaming", on the rows that tier covers) with ``scale`` times the derived bounds of
        ``spec``'s precision chain, ulps in :func:`output_dtype`; None without an exact tier."""
        precision = spec.precision_for(self.case.dtype)
        block_n = spec.block_n_for(self.case)
        if tier == "exact":
            reference, rows = self.exact(), self.sampled_rows()
            if reference is None:
                return None
        elif tier == "float64":
            reference, rows = self.float64(), self.evaluated_rows()
        elif tier == "streaming":
            reference = self.streaming(precision, spec.tile_m, block_n)[0]
            rows = self.evaluated_rows()
        else:
            raise ValueError(f"tier={tier!r} must be 'exact', 'float64' or 'streaming'")
        bound, lse_bound = self.bounds(precision, block_n, tanh_error_ulp=spec.tanh_error_ulp)
        return compare(
            tested,
            reference,
            bound=bound * scale,
            lse_bound=lse_bound * scale,
            output_dtype=output_dtype(spec, self.case.dtype),
            rows=rows,
        )


def case_references(case: AttentionCase, spec: KernelSpec, exact_rows: int) -> CaseReferences:
    """The references :func:`reference_findings` checks ``spec``'s kernel on ``case`` with."""
    return CaseReferences(
        case, rows=exact_rows, device=spec.device, tile_m=spec.tile_m, tile_n=spec.tile_n
    )


def prefetched(refs: CaseReferences, spec: KernelSpec) -> Callable[[], CaseReferences]:
    """Compute, in a thread, the tiers a short case's comparison for ``spec`` reads (float64,
    exact, the bounds), while this thread waits on a kernel worker (the wait releases the GIL);
    returns the join, which gives ``refs`` or raises what the thread raised. A long case's
    tiers depend on the kernel's result (:meth:`CaseReferences.focus`): nothing is started."""
    if refs.long:
        return lambda: refs
    failed: list[BaseException] = []

    def compute() -> None:
        try:
            refs.float64()
            refs.exact()
            block_n = spec.block_n_for(refs.case)
            refs.bounds(
                spec.precision_for(refs.case.dtype), block_n, tanh_error_ulp=spec.tanh_error_ulp
            )
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(error)

    thread = threading.Thread(target=compute, name="references", daemon=True)
    thread.start()

    def join() -> CaseReferences:
        thread.join()
        if failed:
            raise failed[0]
        return refs

    return join


def float64_reference(case: AttentionCase, device: str = "cpu") -> AttentionResult:
    """float64 attention on every row: chunked torch on the GPU for a CUDA kernel's large cases
    (above :data:`TORCH_WORK` multiply-adds, when CUDA is there), else the streaming tier in
    float64 (correct to a few float64 ulps either way; the exact tier certifies sampled rows)."""
    backend = _backend(device)
    if backend["backend"] == "torch" and work(case) > TORCH_WORK:
        return rowwise_attention(case, **backend)
    return streaming_attention(case, StreamingPrecision.float64())


def _backend(device: str) -> dict[str, str]:
    """``reference.rowwise`` backend arguments: torch on the GPU for a CUDA kernel when CUDA is
    there, else NumPy."""
    if device == "cuda":
        from attention_crossval.kernel.harness.gpu_workers import cuda_available

        if cuda_available()[0]:
            return {"backend": "torch", "device": "cuda"}
    return {"backend": "numpy", "device": "cpu"}


def reference_findings(
    case: AttentionCase,
    result: AttentionResult,
    spec: KernelSpec,
    *,
    exact_rows: int = 4,
    references: CaseReferences | None = None,
    hint: bool = True,
) -> list[Finding]:
    """``bound`` / ``lse`` findings: the kernel against float64 (all rows) and exact
    (``exact_rows`` sampled rows), with the derived bounds of the declared precision chain; a
    ``bound`` message carries the triage (kernel vs streaming emulation, emulation vs exact),
    and with ``hint`` every finding names a neighbouring chain that would pass, if one does
    (``kernel.harness.verdict.chain_hint``)."""
    refs = (references or case_references(case, spec, exact_rows)).focus(result)
    reports = {tier: refs.compare(result, tier, spec) for tier in ("float64", "exact")}
    reports = {tier: report for tier, report in reports.items() if report is not None}
    findings = _saturation_findings(case, spec)
    if any(r.mismatched for r in reports.values()):
        findings.append(Finding("bound", _triage(refs, spec, result, reports)))
    if any(r.lse_mismatched for r in reports.values()):
        summary = "; ".join(
            f"{r.lse_mismatched} LSE values outside the bound vs {tier}, "
            f"max |err| {r.lse_max_abs:.3g}"
            for tier, r in reports.items()
            if r.lse_mismatched
        )
        findings.append(Finding("lse", summary))
    if findings and hint:
        recheck = lambda other: reference_findings(  # noqa: E731
            case, result, other, exact_rows=exact_rows, references=refs, hint=False
        )
        line = chain_hint(spec, case.dtype, recheck)
        if line is not None:
            findings = [Finding(f.check, f"{f.message}\n  hint: {line}") for f in findings]
    return findings


def _saturation_findings(case: AttentionCase, spec: KernelSpec) -> list[Finding]:
    """A ``bound`` finding where the declared chain's FP8 P can clamp (docs/fp8.md): the O
    bound is undefined (inf) on those rows, so a pass there would prove nothing."""
    from attention_crossval.reference.bounds import saturating_rows

    precision = spec.precision_for(case.dtype)
    if not precision.can_saturate:
        return []
    rows = saturating_rows(case, precision, block_n=spec.block_n_for(case))
    if not rows.any():
        return []
    top = precision.max_offset_log2 + precision.rescale_threshold_log2
    return [
        Finding(
            "bound",
            f"the declared chain can saturate: max_offset_log2 + rescale_threshold_log2 = "
            f"{top:g} > log2 of the {precision.p_dtype} maximum, so P may clamp and the O bound "
            f"is undefined on {int(rows.sum())} rows (declare constants within the range)",
        )
    ]


def _triage(
    refs: CaseReferences, spec: KernelSpec, result: AttentionResult, reports: dict[str, Any]
) -> str:
    """The three-tier triage of a ``bound`` failure, as text for the finding."""
    lines = [f"kernel vs float64 (all rows): {reports['float64'].summary()}"]
    if "exact" in reports:
        lines.append(f"kernel vs exact (sampled rows): {reports['exact'].summary()}")
    scale = PAIR_BOUND_SCALE["kernel_vs_streaming"]
    kernel_emu = refs.compare(result, "streaming", spec, scale=scale)
    within = "within" if kernel_emu.mismatched == 0 else "OUTSIDE"
    lines.append(f"kernel vs streaming emulation: {within} {scale:g}x the bound")
    emu_ok = True
    if "exact" in reports:
        precision = spec.precision_for(refs.case.dtype)
        emulation = refs.streaming(precision, spec.tile_m, spec.block_n_for(refs.case))[0]
        emu_ok = refs.compare(emulation, "exact", spec).mismatched == 0
        lines.append(f"streaming emulation vs exact: {'within' if emu_ok else 'OUTSIDE'} the bound")
    verdict = (
        "emulation agrees with exact -> kernel implementation bug"
        if emu_ok
        else "emulation fails too -> precision chain or bound"
    )
    return "\n  ".join([*lines, f"triage: {verdict}"])


def timed_memo(
    memo: dict, timings: dict[str, float], key: Any, label: str, compute: Callable[[], Any]
) -> Any:
    """``compute()`` once per ``key`` (memoized), its own seconds added to ``timings[label]``
    and to the phase clock (:mod:`kernel.phases`, as ``label`` without its ``_s``): time spent
    in a nested phase (a bound computing its float64 reference) counts for the nested label
    only, so the phases add up to the wall time."""
    if key not in memo:
        span = None
        try:
            with phase(label.removesuffix("_s")) as span:
                memo[key] = compute()
        finally:
            if span is not None:
                timings[label] = timings.get(label, 0.0) + span.seconds
    return memo[key]
