"""Evaluate configurations: run each kernel, compare every tier pair, write one record each.

Per (config, kernel) the runner builds the case once and computes

* the exact tier on sampled rows (cached on disk, :mod:`report.cache`),
* the streaming tier with the kernel's declared precision chain and tile sizes (with a
  :class:`~reference.streaming.RescaleTrace` for the worst element's story),
* a float64 streaming result on all rows (a row subset for big cases, :mod:`report.subset`),
  from which the derived bound is evaluated
  (``reference.bounds.error_bound``, as shared/notes/numerics.md 4.2 prescribes),

The kernel runs through ``kernel.harness.run_case`` (defensive checks, declared conventions
translated, CUDA kernels in an isolated worker); its output is then compared with
``reference.compare.compare`` for kernel vs exact, kernel vs streaming and streaming vs exact.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from reference.case import AttentionCase, AttentionResult
from reference.masks import visible
from reference.precision import StreamingPrecision
from reference.streaming import RescaleTrace, streaming_attention
from report.cache import ExactCache
from report.plotdata import histogram, row_profile
from report.records import clean
from report.subset import RowSubset

TIERS = ("exact", "streaming")
# Kernel and streaming tier are each within the bound of the exact value, so their difference is
# within twice the bound: the tolerance of the kernel-vs-streaming pair.
PAIR_BOUND_SCALE = {"kernel_vs_exact": 1.0, "kernel_vs_streaming": 2.0, "streaming_vs_exact": 1.0}


@dataclass(frozen=True)
class RunOptions:
    """Knobs that change a record's numbers, hence part of its resume key.

    * ``tiers``: reference tiers to compare against (subset of ``exact``, ``streaming``).
    * ``rows``: query rows sampled per case for the exact tier (``reference.exact.sample_rows``).
    * ``prec_bits``: the exact tier's working precision.
    * ``repeats``: kernel runs per case; > 1 checks bitwise determinism.
    * ``dense_limit``: above ``B*Hq*Sq*Sk*(D+Dv)`` multiply-adds, the float64 and streaming
      results and the bound cover only the exact rows plus ``subset_rows`` evenly spaced rows.
    """

    tiers: tuple[str, ...] = TIERS
    rows: int = 32
    prec_bits: int = 128
    repeats: int = 2
    row_seed: int = 0
    dense_limit: int = 1 << 31
    subset_rows: int = 256

    def __post_init__(self) -> None:
        if not self.tiers or set(self.tiers) - set(TIERS):
            raise ValueError(f"tiers={list(self.tiers)} must be a non-empty subset of {TIERS}")
        if self.rows < 1:
            raise ValueError(f"rows={self.rows!r} must be >= 1")
        if self.prec_bits < 64:
            raise ValueError(f"prec_bits={self.prec_bits!r} must be >= 64")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be >= 1")

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class _CaseContext:
    """What every kernel of one config shares: the case and its tier results, computed lazily.

    Cases above ``options.dense_limit`` multiply-adds get the float64 result, the streaming
    emulation and the bound on a row subset only (:mod:`report.subset`): the exact tier's
    sampled rows plus ``options.subset_rows`` evenly spaced ones.
    """

    case: AttentionCase
    options: RunOptions
    exact_cache: ExactCache
    timings: dict[str, float] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict)

    def _timed(self, key, label: str, compute: Callable):
        if key not in self._memo:
            start = time.perf_counter()
            self._memo[key] = compute()
            self.timings[label] = self.timings.get(label, 0.0) + time.perf_counter() - start
        return self._memo[key]

    def rows(self) -> np.ndarray:
        from reference.exact import sample_rows

        options = self.options
        return self._timed(
            "rows", "exact_s", lambda: sample_rows(self.case, options.rows, options.row_seed)
        )

    def exact(self):
        compute = lambda: self.exact_cache.get(self.case, self.rows(), self.options.prec_bits)  # noqa: E731
        return self._timed("exact", "exact_s", compute)

    def subset(self) -> RowSubset | None:
        """The evaluated row subset, or None when every row is evaluated."""
        case = self.case
        work = case.B * case.Hq * case.Sq * case.Sk * (case.D + case.Dv)
        if work <= self.options.dense_limit:
            return None

        def compute():
            spread = np.linspace(0, case.Sq - 1, min(self.options.subset_rows, case.Sq))
            sampled = np.flatnonzero(self.rows().any(axis=(0, 1)))
            return RowSubset.of(case, np.concatenate([spread.round().astype(int), sampled]))

        return self._timed("subset", "streaming_s", compute)

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
        compute = lambda: streaming_attention(self._evaluated_case(), StreamingPrecision.float64())  # noqa: E731
        return self._timed("float64", "streaming_s", compute)

    def float64(self) -> AttentionResult:
        """float64 streaming result, full shape (NaN on rows not evaluated)."""
        return self._on_rows(self._float64_evaluated())

    def streaming(self, precision: StreamingPrecision, tile_m: int, tile_n: int):
        """The emulated result and a ``row -> (b, h, i) rescale count`` reader of its trace."""

        def compute():
            trace = RescaleTrace()
            result = streaming_attention(
                self._evaluated_case(), precision, block_m=tile_m, block_n=tile_n, trace=trace
            )
            subset = self.subset()
            index = (lambda i: i) if subset is None else subset.index
            return self._on_rows(result), lambda b, h, i: (
                int(trace.rescales[b, h, index(i)]),
                int(trace.visible_blocks[b, h, index(i)]),
            )

        return self._timed(("streaming", precision, tile_m, tile_n), "streaming_s", compute)

    def bounds(self, precision: StreamingPrecision, tile_n: int) -> tuple[np.ndarray, np.ndarray]:
        """Derived bounds on O ``[B, Sq, Hq, Dv]`` and on the LSE ``[B, Hq, Sq]`` (NaN on rows
        not evaluated)."""
        from reference.bounds import error_bound, lse_error_bound

        def compute():
            case, reference = self._evaluated_case(), self._float64_evaluated()
            bound = error_bound(case, reference, precision, block_n=tile_n)
            lse_bound = lse_error_bound(case, reference, precision, block_n=tile_n)
            subset = self.subset()
            if subset is None:
                return bound, lse_bound
            return subset.scatter_o(bound), subset.scatter_rows(lse_bound)

        return self._timed(("bound", precision, tile_n), "bound_s", compute)


def record_key(config, kernel: str, options: RunOptions) -> str:
    """Identity of a record for resuming: config recipe, kernel name and run options."""
    return f"{config.name}|{config.digest}|{kernel}|{options.digest}"


@dataclass
class Kernel:
    """A kernel under test: its report name, adapter, and the isolated worker that runs it
    (``kernel.harness.IsolatedKernel``: crashes and hangs become findings), or None to run it
    in this process."""

    name: str
    adapter: object
    isolated: object | None = None

    @property
    def spec(self):
        return self.adapter.spec


def evaluate(
    config, kernels: Sequence[Kernel], options: RunOptions, cache: ExactCache
) -> Iterator[dict]:
    """Records (dicts, schema in report/schema.json) of ``config``, one per kernel, yielded as
    each finishes so the caller can log it at once."""
    start = time.perf_counter()
    try:
        case = config.build()
    except ValueError as error:
        for kernel in kernels:
            yield _failed_record(config, kernel, options, "error", f"build: {error}")
        return
    context = _CaseContext(case, options, cache)
    context.timings["build_s"] = time.perf_counter() - start
    for kernel in kernels:
        yield _evaluate_kernel(config, case, kernel, options, context)


def _run(kernel: Kernel, case: AttentionCase, options: RunOptions):
    """The harness verdict (defensive checks, declared conventions translated), or the
    exception text when an in-process kernel raised."""
    from kernel.harness import run_case

    try:
        return run_case(
            kernel.adapter, case, isolated=kernel.isolated, repeats=options.repeats, compare=False
        )
    except Exception as error:  # an in-process kernel's exception is a finding, not a crash
        return f"{type(error).__name__}: {error}"


def _evaluate_kernel(config, case, kernel: Kernel, options, context: _CaseContext) -> dict:
    from reference.compare import compare

    spec = kernel.spec
    verdict = _run(kernel, case, options)
    if isinstance(verdict, str):
        return _failed_record(config, kernel, options, "error", verdict)
    if verdict.skipped is not None:
        return _failed_record(config, kernel, options, "unsupported", verdict.skipped)
    findings = [{"check": f.check, "message": f.message} for f in verdict.findings]
    if verdict.result is None:
        message = "; ".join(f"{f['check']}: {f['message']}" for f in findings)
        return _failed_record(config, kernel, options, "error", message, findings)
    actual = verdict.result
    precision = spec.precision_for(case.dtype)
    output_dtype = precision.output_dtype or precision.accum_dtype
    bound, lse_bound = context.bounds(precision, spec.tile_n)
    streamed, rescales = context.streaming(precision, spec.tile_m, spec.tile_n)
    exact = context.exact() if "exact" in options.tiers else None
    rows = context.rows() if exact is not None else None
    references = {
        "kernel_vs_exact": (actual, exact, rows),
        "kernel_vs_streaming": (
            actual,
            streamed if "streaming" in options.tiers else None,
            context.evaluated_rows(),
        ),
        "streaming_vs_exact": (streamed, exact, rows),
    }
    pairs = {}
    for pair, (tested, reference, pair_rows) in references.items():
        if reference is None:
            continue
        scale = PAIR_BOUND_SCALE[pair]
        report = compare(
            tested,
            reference,
            bound=bound * scale,
            lse_bound=lse_bound * scale,
            output_dtype=output_dtype,
            rows=pair_rows,
        )
        pairs[pair] = {**report.to_dict(), "bound_scale": scale}
    primary = "kernel_vs_exact" if "kernel_vs_exact" in pairs else "kernel_vs_streaming"
    checked = options.repeats > 1 and spec.deterministic and "determinism" in verdict.applied
    differs = verdict.failed("determinism")
    passed = all(p["passed"] for p in pairs.values()) and not findings
    reference64 = context.float64()
    return clean(
        {
            "key": record_key(config, kernel.name, options),
            "config": config.fields(),
            "case": case.describe(),
            "kernel": _kernel_info(kernel),
            "status": "ok",
            "message": None,
            "verdict": "pass" if passed else "fail",
            "output_dtype": output_dtype,
            "pairs": pairs,
            "primary_pair": primary,
            "worst": _worst_story(case, pairs[primary], rescales),
            "determinism": {"checked": checked, "bitwise_equal": not differs if checked else None},
            "findings": findings,
            "declared": list(verdict.declared),
            "histogram": histogram(actual, exact, rows, reference64, bound),
            "row_profile": row_profile(actual, reference64, bound),
            "timing": {**context.timings, "kernel_s": verdict.seconds / options.repeats},
        }
    )


def _failed_record(config, kernel: Kernel, options, status: str, message: str, findings=()) -> dict:
    return clean(
        {
            "key": record_key(config, kernel.name, options),
            "config": config.fields(),
            "case": None,
            "kernel": _kernel_info(kernel),
            "status": status,
            "message": message,
            "verdict": "error" if status == "error" else "unsupported",
            "pairs": {},
            "findings": list(findings),
        }
    )


def _kernel_info(kernel: Kernel) -> dict:
    spec = kernel.spec
    return {
        "name": kernel.name,
        "spec_name": spec.name,
        "device": spec.device,
        "isolated": kernel.isolated is not None,
        "tile_m": spec.tile_m,
        "tile_n": spec.tile_n,
        "deterministic": spec.deterministic,
        "returns_lse": spec.returns_lse,
    }


def _worst_story(case: AttentionCase, pair: dict, rescales: Callable) -> dict | None:
    """The worst element's position and what its row went through: the row's largest scaled
    score, how often the streaming max was rescaled, how many K blocks it saw."""
    index = pair.get("worst_index")
    if index is None:
        return None
    b, i, h, c = (int(x) for x in index)
    seen = visible(case, b, h, [i])[0]
    with np.errstate(all="ignore"):  # padded keys may hold NaN/Inf; they are not `seen`
        scores = (
            case.q[b, i, h].astype(np.float64) @ case.k[b, :, case.kv_head(h)].astype(np.float64).T
        )
    row_max = float(np.max(scores[seen]) * case.softmax_scale) if seen.any() else None
    count, blocks = rescales(b, h, i)
    return {
        "b": b,
        "row": i,
        "head": h,
        "col": c,
        "row_max": row_max,
        "visible_keys": int(seen.sum()),
        "rescales": count,
        "visible_blocks": blocks,
    }
