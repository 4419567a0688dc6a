"""Evaluate configurations: run each kernel, compare every tier pair, write one record each.

Per config the runner builds the case once; its reference tiers come from one
:class:`kernel.harness.references.CaseReferences` shared by the config's kernels (the same code the
harness's ``bound`` / ``lse`` checks use), which computes

* the exact tier on sampled rows (cached on disk, :mod:`report.cache`),
* the streaming tier with the kernel's declared precision chain and tile sizes (with a
  :class:`~reference.streaming.RescaleTrace` for the worst element's story),
* a float64 streaming result on all rows (a row subset for big cases, :mod:`reference.subset`),
  from which the derived bound is evaluated
  (``reference.bounds.error_bound``, derived in docs/numerics.md#error-bound),

The kernel runs through ``kernel.harness.forward.run_case`` (defensive checks, declared conventions
translated, CUDA kernels in an isolated worker;
:func:`kernel.harness.known.run_with_known`
reruns a case whose NaN padding reached the output with zero padding, so the other checks
still apply); its output is then compared with ``reference.compare.compare`` for kernel vs
exact, kernel vs streaming and streaming vs exact. A record whose failed checks are all declared
known findings of its kernel (``KernelSpec.known_findings``) gets the verdict ``known``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from attention_crossval.kernel.harness.known import covering, run_with_known
from attention_crossval.kernel.harness.mapped import release
from attention_crossval.kernel.harness.references import (
    PAIR_BOUND_SCALE,
    CaseReferences,
    output_dtype,
)
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.exact import check_prec_bits
from attention_crossval.reference.masks import visible
from attention_crossval.report.backward import PASSES, backward_section, with_backward
from attention_crossval.report.cache import ExactCache
from attention_crossval.report.plotdata import histogram, row_profile

if TYPE_CHECKING:
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.report.records import clean

TIERS = ("exact", "streaming")


@dataclass(frozen=True)
class RunOptions:
    """Knobs that change a record's numbers, hence part of its resume key.

    * ``tiers``: reference tiers to compare against (subset of ``exact``, ``streaming``).
    * ``rows``: query rows sampled per case for the exact tier (``reference.exact.sample_rows``).
    * ``prec_bits``: the exact tier's working precision.
    * ``repeats``: kernel runs per case; > 1 checks bitwise determinism.
    * ``dense_limit``: above ``B*Hq*Sq*Sk*(D+Dv)`` multiply-adds, the float64 and streaming
      results and the bound cover only the exact rows plus ``subset_rows`` evenly spaced rows.
    * ``passes``: "forward", "backward" (dq/dk/dv, :mod:`report.backward`) or "both"; left out
      of the digest when "forward", so forward records keep their keys.
    """

    tiers: tuple[str, ...] = TIERS
    rows: int = 32
    prec_bits: int = 128
    repeats: int = 2
    row_seed: int = 0
    dense_limit: int = 1 << 31
    subset_rows: int = 256
    passes: str = "forward"

    def __post_init__(self) -> None:
        if not self.tiers or set(self.tiers) - set(TIERS):
            raise ValueError(f"tiers={list(self.tiers)} must be a non-empty subset of {TIERS}")
        if self.rows < 1:
            raise ValueError(f"rows={self.rows!r} must be >= 1")
        check_prec_bits(self.prec_bits)
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be >= 1")
        if self.passes not in PASSES:
            raise ValueError(f"passes={self.passes!r} must be one of {list(PASSES)}")

    @property
    def digest(self) -> str:
        fields = asdict(self)
        if self.passes == "forward":
            del fields["passes"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def record_key(config, kernel: str, options: RunOptions) -> str:
    """Identity of a record for resuming: config recipe, kernel name and run options."""
    return f"{config.name}|{config.digest}|{kernel}|{options.digest}"


@dataclass
class Kernel:
    """A kernel under test: its report name, adapter, and the isolated worker that runs it
    (``kernel.harness.forward.IsolatedKernel``: crashes and hangs become findings), or None to run
    it
    in this process."""

    name: str
    adapter: object
    isolated: IsolatedKernel | None = None

    @property
    def spec(self):
        return self.adapter.spec


def evaluate(
    config, kernels: Sequence[Kernel], options: RunOptions, cache: ExactCache
) -> Iterator[dict]:
    """Records (dicts, schema in report/schema.json) of ``config``, one per kernel, yielded as
    each finishes so the caller can log it at once."""
    start = time.perf_counter()
    for kernel in kernels:  # a worker not yet started starts while the case is built
        if kernel.isolated is not None:
            kernel.isolated.launch()
    try:
        case = config.build()
    except ValueError as error:
        for kernel in kernels:
            yield _failed_record(config, kernel, options, "error", f"build: {error}")
        return
    context = _references(case, options, cache, kernels[0].spec if kernels else None)
    build_s = time.perf_counter() - start
    forward = options.passes != "backward"
    for kernel in kernels:
        begin, before = time.perf_counter(), dict(context.timings)
        if forward:
            record = _evaluate_kernel(config, case, kernel, options, context)
        else:  # the backward decides the verdict and status
            record = _failed_record(config, kernel, options, "unsupported", None)
            record["case"] = case.describe()
        if "timing" in record:
            record["timing"] = _phases(record["timing"], context.timings, before, begin, build_s)
            build_s = 0.0  # the first record paid for the build
        if options.passes != "forward":
            seed = config.fields().get("seed") or 0
            do = config.fields().get("do_distribution") or "gaussian"
            section = backward_section(case, seed, kernel, options, do)
            record = clean(with_backward(record, section, forward_ran=forward))
        yield record
    release()  # the case's mapped file, if its inputs were large (kernel.harness.mapped)


# The phases of a forward record's wall time (docs/long-context.md#timing); they add up to
# ``total_s`` but for ``unaccounted_s``. ``kernel_s`` (one kernel call, a mean inside
# ``harness_s``) is not a phase.
PHASES = (
    "build_s",
    "harness_s",
    "sample_s",
    "scan_s",
    "float64_s",
    "streaming_s",
    "bound_s",
    "exact_s",
    "compare_s",
    "record_s",
)


def _phases(
    own: dict, shared: dict, before: dict, begin: float, build_s: float
) -> dict[str, float]:
    """A record's timing: its own phases, the reference phases computed while it was evaluated
    (``shared`` minus ``before``: the first kernel of a config pays for the shared tiers), the
    build for the first record, the total wall time and the part no phase accounts for."""
    timing = {key: shared[key] - before.get(key, 0.0) for key in shared}
    timing.update(own, build_s=build_s)
    timing["total_s"] = time.perf_counter() - begin + build_s
    timing["unaccounted_s"] = timing["total_s"] - sum(timing.get(p, 0.0) for p in PHASES)
    return timing


def _references(
    case: AttentionCase, options: RunOptions, cache: ExactCache, spec=None
) -> CaseReferences:
    """The tiers every kernel of one config shares; the exact tier through the on-disk cache;
    the row plan of a long case follows the first kernel's tiles, and its device picks where
    the float64 reference and the scan run."""
    tiles = {} if spec is None else {"tile_m": spec.tile_m, "tile_n": spec.tile_n}
    return CaseReferences(
        case,
        rows=options.rows,
        row_seed=options.row_seed,
        prec_bits=options.prec_bits,
        dense_limit=options.dense_limit,
        subset_rows=options.subset_rows,
        device="cpu" if spec is None else spec.device,
        exact_source=cache.get,
        **tiles,
    )


def _run(kernel: Kernel, case: AttentionCase, options: RunOptions):
    """The harness verdict (defensive checks, declared conventions translated), or the
    exception text when an in-process kernel raised."""
    try:
        return run_with_known(
            kernel.adapter, case, isolated=kernel.isolated, repeats=options.repeats, compare=False
        )
    except Exception as error:  # an in-process kernel's exception is a finding, not a crash
        return f"{type(error).__name__}: {error}"


def _evaluate_kernel(config, case, kernel: Kernel, options, context: CaseReferences) -> dict:
    spec = kernel.spec
    started = time.perf_counter()
    verdict = _run(kernel, case, options)
    harness_s = time.perf_counter() - started
    if isinstance(verdict, str):
        return _failed_record(config, kernel, options, "error", verdict)
    if verdict.skipped is not None:
        return _failed_record(config, kernel, options, "unsupported", verdict.skipped)
    known = {f.check: covering(spec, case, [f]) for f in verdict.findings}
    findings = [
        {"check": f.check, "message": f.message, **({"known": True} if known[f.check] else {})}
        for f in verdict.findings
    ]
    declared_known = list(dict.fromkeys(k for ks in known.values() for k in ks))
    if verdict.result is None:
        message = "; ".join(f"{f['check']}: {f['message']}" for f in findings)
        return _failed_record(config, kernel, options, "error", message, findings)
    actual = verdict.result
    context = context.focus(actual)  # a long case: plus the rows where this kernel looks worst
    precision = spec.precision_for(case.dtype)
    block_n = spec.block_n_for(context.case)
    bound, _ = context.bounds(precision, block_n, tanh_error_ulp=spec.tanh_error_ulp)
    streamed, rescales = context.streaming(precision, spec.tile_m, block_n)
    exact = context.exact() if "exact" in options.tiers else None
    rows = context.sampled_rows() if exact is not None else None
    reference64 = context.float64()
    started = time.perf_counter()
    pairs = {}
    for pair, tested, tier, wanted in (
        ("kernel_vs_exact", actual, "exact", "exact"),
        ("kernel_vs_streaming", actual, "streaming", "streaming"),
        ("streaming_vs_exact", streamed, "exact", "exact"),
    ):
        if wanted in options.tiers:
            scale = PAIR_BOUND_SCALE[pair]
            report = context.compare(tested, tier, spec, scale=scale)
            pairs[pair] = {**report.to_dict(), "bound_scale": scale}
    primary = "kernel_vs_exact" if "kernel_vs_exact" in pairs else "kernel_vs_streaming"
    checked = options.repeats > 1 and spec.deterministic and "determinism" in verdict.applied
    differs = verdict.failed("determinism")
    pairs_passed = all(p["passed"] for p in pairs.values())
    if pairs_passed and not findings:
        outcome = "pass"
    elif pairs_passed and all(known.values()):
        outcome = "known"
    else:
        outcome = "fail"
    compare_s = time.perf_counter() - started
    worst = _worst_story(case, pairs[primary], rescales)
    plots = {
        "histogram": histogram(actual, exact, rows, reference64, bound),
        "row_profile": row_profile(actual, reference64, bound),
    }
    record_s = time.perf_counter() - started - compare_s
    timing = {"harness_s": harness_s, "compare_s": compare_s, "record_s": record_s}
    return clean(
        {
            "key": record_key(config, kernel.name, options),
            "config": config.fields(),
            "case": case.describe(),
            "kernel": _kernel_info(kernel),
            "status": "ok",
            "message": None,
            "verdict": outcome,
            "output_dtype": output_dtype(spec, case.dtype),
            "pairs": pairs,
            "primary_pair": primary,
            "worst": worst,
            "determinism": {"checked": checked, "bitwise_equal": not differs if checked else None},
            "findings": findings,
            "known_findings": [k.to_dict() for k in declared_known],
            "declared": list(verdict.declared),
            **plots,
            **({"sampling": _sampling(context)} if context.long else {}),
            "timing": {**timing, "kernel_s": verdict.seconds / options.repeats},
        }
    )


def _sampling(context: CaseReferences) -> dict:
    """A long case's row plan: rows evaluated (over batches and heads), exact rows, and the
    positions each reason picked (docs/long-context.md#sampling)."""
    evaluated, exact = context.evaluated_rows(), context.sampled_rows()
    return {
        "rows": int(evaluated.sum()),
        "exact_rows": 0 if exact is None else int(exact.sum()),
        "positions": context.plan().summary(),
    }


def _failed_record(
    config, kernel: Kernel, options, status: str, message: str | None, findings=()
) -> dict:
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
