"""Compare a tier's output with a reference: one engine, thin asserts (as numpy.testing).

:func:`compare` computes every metric once into an :class:`ErrorReport`;
:func:`assert_within_bound` only formats a failure from it (``__tracebackhide__``) and returns
the report, like ``numpy.testing.assert_array_max_ulp``.

Metrics over the *evaluated* elements (reference not NaN, ``ExactResult.rows`` and the optional
``rows`` selection):

* ``abs``: ``|actual - exact|`` with ``exact = o + o_lo`` (``o_lo`` only for an ExactResult).
* ``rel``: ``abs / max(|exact|, tiny)``, ``tiny`` the smallest normal of the output dtype, so an
  exact zero does not divide by zero.
* ``ulp``: ``|actual - r| / ulp(r)``, ``r`` the exact value *correctly rounded* to the output
  dtype (a double-double tie is resolved by the sign of ``o_lo``) and ``ulp(r)`` the spacing of
  the output dtype in ``r``'s binade (the subnormal spacing below the normal range). A correctly
  rounded kernel scores 0.
* near zero: with a finite bound, elements whose reference lies within it of zero
  (``|exact| < bound``): the ulp of a value that may as well be 0 measures nothing (the
  subnormal spacing made errors read as 1e40 ulp), so ``max_ulp`` / ``p99_ulp`` leave them out
  (unless the actual value is non-finite), as does ``max_rel``, and ``near_zero_max_abs`` /
  ``near_zero_max_bound_fraction`` give their absolute error against the bound instead.
* ``bound fraction``: ``abs / bound`` (0 / 0 = 0, x / 0 = inf).
* mismatched: ``abs > bound``, a non-finite actual where the reference is finite, or an
  infinite reference not matched by the same infinity (a NaN always mismatches, even with
  ``bound=None``). Two exceptions, where the declared chain may overflow: an infinite bound
  admits +-inf where the reference is finite, and an element marked ``undefined`` (with an
  infinite bound) admits anything, NaN included; both score a bound fraction of 0.
* ``bound`` / ``lse_bound`` must be >= 0 (inf allowed) on evaluated elements: a NaN or negative
  bound raises ValueError (``err > NaN`` is False and would pass anything).
* vacuous: evaluated elements whose bound is inf or at least their row's V range (``v_range``,
  e.g. :func:`reference.bounds.visible_v_range`; without it only inf counts). There the bound
  cannot tell the right weighting of V from a wrong one: a pass there proves little.
* LSE: ``|actual - reference|`` per row with ``-inf == -inf`` an error of 0 and any other
  disagreement involving an infinity or NaN an error of inf.

Whether a value is accepted is decided in one place, :func:`outside_tolerance`, which every
tolerance comparison of the harnesses goes through (docs/faults.md, "Non-finite values in the
checks"): ``|got - expected| <= tolerance`` alone accepts every finite ``got`` when
``expected`` is infinite and the tolerance relative (``inf <= inf``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attention_crossval.reference.bounds import format_info
from attention_crossval.reference.case import AttentionResult
from attention_crossval.reference.precision import round_to

OUTPUT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class ErrorReport:
    """Error metrics of one comparison (see the module docstring for definitions).

    ``worst_*`` describe the element with the largest bound fraction (largest abs error when
    there is no bound), index ``(b, i, h, c)`` into ``o [B, Sq, Hq, Dv]``; None when nothing was
    evaluated. ``max_bound_fraction`` and ``worst_bound`` are None without a bound,
    ``lse_max_abs`` is None when either side has no LSE.
    """

    output_dtype: str
    max_abs: float
    max_rel: float
    max_ulp: float
    p99_ulp: float
    max_bound_fraction: float | None
    worst_index: tuple[int, int, int, int] | None
    worst_actual: float | None
    worst_reference: float | None
    worst_bound: float | None
    worst_abs: float | None
    worst_ulp: float | None
    lse_max_abs: float | None
    lse_mismatched: int
    nonfinite: int
    mismatched: int
    total: int
    passed: bool
    vacuous: int = 0
    near_zero: int = 0
    near_zero_max_abs: float | None = None
    near_zero_max_bound_fraction: float | None = None

    def summary(self) -> str:
        """One line: verdict, mismatches, worst element, ulps, LSE."""
        verdict = "PASS" if self.passed else "FAIL"
        pct = 100.0 * self.mismatched / self.total if self.total else 0.0
        parts = [f"{verdict} {self.mismatched}/{self.total} ({pct:.3g}%) mismatched"]
        if self.near_zero < self.total or self.nonfinite:
            parts += [
                f"max |err| {self.max_abs:.3g}, max rel {self.max_rel:.3g}",
                f"max {self.max_ulp:.3g} ulp / p99 {self.p99_ulp:.3g} ulp ({self.output_dtype})",
            ]
        if self.near_zero:
            parts.append(
                f"near-zero references {self.near_zero} (no ulps there): max |err| "
                f"{self.near_zero_max_abs:.3g} = {self.near_zero_max_bound_fraction:.3g} x bound"
            )
        if self.max_bound_fraction is not None:
            parts.append(f"max {self.max_bound_fraction:.3g} x bound")
        if self.worst_index is not None:
            parts.append(f"worst at (b,i,h,c)={self.worst_index}")
        parts.append(f"non-finite {self.nonfinite}")
        if self.vacuous:
            parts.append(f"vacuous bound on {self.vacuous}/{self.total}")
        if self.lse_max_abs is not None:
            parts.append(f"lse max |err| {self.lse_max_abs:.3g} ({self.lse_mismatched} mismatched)")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        """Plain Python values (floats may be inf/nan; ``json.dumps`` writes them as Infinity)."""
        out = dataclasses.asdict(self)
        if self.worst_index is not None:
            out["worst_index"] = list(self.worst_index)
        return out


def compare(
    actual: AttentionResult,
    reference: AttentionResult,
    *,
    bound: np.ndarray | None,
    output_dtype: str,
    rows: np.ndarray | None = None,
    lse_bound: np.ndarray | None = None,
    v_range: np.ndarray | None = None,
    undefined: np.ndarray | None = None,
) -> ErrorReport:
    """Metrics of ``actual`` against ``reference`` (an ``AttentionResult`` or an ``ExactResult``,
    whose ``o_lo`` and ``rows`` are used). ``bound`` is ``[B, Sq, Hq, Dv]`` (e.g. from
    :func:`reference.bounds.error_bound`), ``rows``, ``lse_bound`` and ``v_range`` (each row's
    V range, :func:`reference.bounds.visible_v_range`, for counting vacuous bounds) are
    ``[B, Hq, Sq]``. ``undefined`` (bool, the shape of ``bound``) marks elements where the
    declared chain may produce any value, NaN included (its bound must be inf there).
    """
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype={output_dtype!r} must be one of {OUTPUT_DTYPES}")
    hi = np.asarray(reference.o, dtype=np.float64)
    shape = hi.shape
    a = _as_shape("actual.o", actual.o, shape)
    lo = getattr(reference, "o_lo", None)
    lo = np.zeros(shape) if lo is None else _as_shape("reference.o_lo", lo, shape)
    row_mask = _row_mask(shape, rows, getattr(reference, "rows", None))
    if row_mask.size and row_mask.mean() < 0.5:  # a row sample (long cases): gather it first
        return _on_rows(
            actual, reference, bound, lse_bound, v_range, output_dtype, row_mask, undefined
        )
    evaluated = ~np.isnan(hi) & row_mask.transpose(0, 2, 1)[..., None]
    lo = np.where(np.isfinite(hi) & np.isfinite(lo), lo, 0)

    err = _abs_error(a, hi, lo)
    info = format_info(output_dtype)
    rel = err / np.maximum(np.abs(hi), float(info.tiny))
    rounded = correctly_rounded(hi, lo, output_dtype)
    ulp = _abs_error(a, rounded, np.zeros(shape)) / ulp_of(rounded, output_dtype)
    if bound is None:  # only non-finite disagreements count
        mismatch = outside_tolerance(a, hi, np.inf, expected_lo=lo, where=evaluated)
        fraction, score = None, err
    else:
        bound = _as_shape("bound", bound, shape)
        # An infinite bound (the declared chain may overflow there) admits +-inf, never NaN
        # unless the chain's result is undefined there.
        overflow = np.isinf(bound)
        undefined = (
            np.zeros(shape, bool)
            if undefined is None
            else _as_shape("undefined", undefined, shape).astype(bool) & overflow
        )
        mismatch = outside_tolerance(
            a, hi, bound, expected_lo=lo, where=evaluated, inf_ok=overflow, nan_ok=undefined,
            name="bound",
        )  # fmt: skip
        with np.errstate(divide="ignore", invalid="ignore"):
            fraction = np.where(err == 0, 0.0, err / bound)
        fraction = np.where(np.isnan(fraction), np.inf, fraction)
        admitted = (overflow & np.isinf(a)) | undefined
        fraction = np.where(admitted, 0.0, fraction)  # an admitted overflow
        score = fraction
    vacuous = _vacuous(bound, v_range, shape) & evaluated
    near_zero = np.zeros(shape, dtype=bool)
    if bound is not None:
        with np.errstate(invalid="ignore"):
            near_zero = evaluated & np.isfinite(bound) & (np.abs(hi + lo) < bound)
    in_ulps = evaluated & (~near_zero | ~np.isfinite(a))

    total = int(evaluated.sum())
    lse_max_abs, lse_mismatched = _lse_errors(actual, reference, row_mask, lse_bound)
    if total == 0:
        nothing = dict.fromkeys(("worst_index", "worst_actual", "worst_reference", "worst_bound"))
        return ErrorReport(
            output_dtype=output_dtype,
            max_abs=0.0,
            max_rel=0.0,
            max_ulp=0.0,
            p99_ulp=0.0,
            max_bound_fraction=None if bound is None else 0.0,
            **nothing,
            worst_abs=None,
            worst_ulp=None,
            lse_max_abs=lse_max_abs,
            lse_mismatched=lse_mismatched,
            nonfinite=0,
            mismatched=0,
            total=0,
            passed=lse_mismatched == 0,
            vacuous=0,
        )
    flat = np.argmax(np.where(evaluated, score, -1.0))
    worst = tuple(int(i) for i in np.unravel_index(flat, shape))
    mismatched = int((mismatch & evaluated).sum())
    return ErrorReport(
        output_dtype=output_dtype,
        max_abs=float(err[evaluated].max()),
        max_rel=float(rel[in_ulps].max(initial=0.0)),
        max_ulp=float(ulp[in_ulps].max(initial=0.0)),
        p99_ulp=float(np.quantile(ulp[in_ulps], 0.99, method="higher")) if in_ulps.any() else 0.0,
        max_bound_fraction=None if fraction is None else float(fraction[evaluated].max()),
        worst_index=worst,
        worst_actual=float(a[worst]),
        worst_reference=float(hi[worst] + lo[worst]),
        worst_bound=None if bound is None else float(bound[worst]),
        worst_abs=float(err[worst]),
        worst_ulp=float(ulp[worst]),
        lse_max_abs=lse_max_abs,
        lse_mismatched=lse_mismatched,
        nonfinite=int((~np.isfinite(a) & evaluated).sum()),
        mismatched=mismatched,
        total=total,
        passed=mismatched == 0 and lse_mismatched == 0,
        vacuous=int(vacuous.sum()),
        near_zero=int(near_zero.sum()),
        near_zero_max_abs=float(err[near_zero].max()) if near_zero.any() else None,
        near_zero_max_bound_fraction=(
            float(fraction[near_zero].max()) if near_zero.any() else None
        ),
    )


def assert_within_bound(
    actual: AttentionResult,
    reference: AttentionResult,
    bound: np.ndarray,
    *,
    output_dtype: str,
    reproducer: str = "",
    rows: np.ndarray | None = None,
    lse_bound: np.ndarray | None = None,
    streaming: AttentionResult | None = None,
    v_range: np.ndarray | None = None,
) -> ErrorReport:
    """Raise ``AssertionError`` unless every evaluated element is within ``bound`` (and every
    LSE within ``lse_bound``); return the :class:`ErrorReport`. ``streaming`` (tier 2's result)
    only adds its value at the worst element to the message, for triage.
    """
    __tracebackhide__ = True
    report = compare(
        actual, reference, bound=bound, output_dtype=output_dtype, rows=rows,
        lse_bound=lse_bound, v_range=v_range,
    )  # fmt: skip
    if not report.passed:
        raise AssertionError(failure_message(report, reproducer, streaming))
    return report


def failure_message(
    report: ErrorReport, reproducer: str = "", streaming: AttentionResult | None = None
) -> str:
    """The multi-line explanation of a failed :class:`ErrorReport`."""
    pct = 100.0 * report.mismatched / report.total if report.total else 0.0
    lines = [
        f"attention output outside the derived bound: {report.mismatched} / {report.total} "
        f"elements ({pct:.3g}%) mismatched, output dtype {report.output_dtype}"
    ]
    if report.worst_index is not None:
        fraction = report.max_bound_fraction
        times = "" if fraction is None else f" = {fraction:.3g} x bound"
        ulps = f" = {report.worst_ulp:.3g} ulp({report.output_dtype})"
        if report.worst_bound is not None and abs(report.worst_reference) < report.worst_bound:
            ulps = " (near-zero reference: no ulps)"
        lines.append(
            f"worst at (b, i, h, c) = {report.worst_index}: error {report.worst_abs:.3g}{ulps}"
            f"{times}"
        )
        values = f"kernel {report.worst_actual!r} | reference {report.worst_reference!r}"
        if report.worst_bound is not None:
            values += f" | bound {report.worst_bound:.3g}"
        if streaming is not None:
            values += f" | streaming {float(np.asarray(streaming.o)[report.worst_index])!r}"
        lines.append(values)
    lines.append(report.summary())
    if reproducer:
        lines.append(f"reproduce: {reproducer}")
    return "\n".join(lines)


def correctly_rounded(hi: np.ndarray, lo: np.ndarray, dtype: str) -> np.ndarray:
    """``hi + lo`` (a double-double, ``hi`` the nearest double) rounded to nearest in ``dtype``.

    Rounding ``hi`` alone is correct unless ``hi`` is exactly a midpoint of ``dtype`` (every
    midpoint of a narrower format is a double); then the sign of ``lo`` picks the side, and
    ``lo == 0`` is a true tie (round half to even, as ``round_to`` does).
    """
    hi = np.asarray(hi, dtype=np.float64)
    r = round_to(hi, dtype)
    if dtype == "float64":
        return r
    native = np.dtype(format_info(dtype).dtype)
    direction = np.where(hi > r, np.inf, -np.inf).astype(native)
    with np.errstate(invalid="ignore", over="ignore"):
        toward = np.nextafter(r.astype(native), direction).astype(np.float64)  # hi's other side
        tie = np.isfinite(r) & (hi != r) & (2 * hi == r + toward)
    return np.where(tie & (lo != 0) & (np.sign(lo) == np.sign(hi - r)), toward, r)


def ulp_of(x: np.ndarray, dtype: str) -> np.ndarray:
    """Spacing of ``dtype`` in the binade of each (representable) ``x``: ``2^(e - mantissa
    bits)`` with ``e = max(floor(log2|x|), min exponent)``; the top binade's spacing for inf."""
    info = format_info(dtype)
    x = np.abs(np.asarray(x, dtype=np.float64))
    _, exponent = np.frexp(np.where(np.isfinite(x), x, float(info.max)))
    binade = np.where(x == 0, info.minexp, np.maximum(exponent - 1, info.minexp))
    return np.ldexp(1.0, binade - info.nmant)


def outside_tolerance(
    got: np.ndarray,
    expected: np.ndarray | float,
    tolerance: np.ndarray | float,
    *,
    expected_lo: np.ndarray | None = None,
    where: np.ndarray | bool = True,
    inf_ok: np.ndarray | bool = False,
    nan_ok: np.ndarray | bool = False,
    name: str = "tolerance",
) -> np.ndarray:
    """Bool mask (the broadcast shape, False outside ``where``) of the values ``got`` that are
    not accepted for ``expected``. Non-finite values are decided explicitly, never by the
    arithmetic (``|x - inf| <= inf`` holds for every finite x; ``NaN <= t`` is False):

    * ``expected`` finite: ``got`` finite and ``|got - (expected + expected_lo)| <= tolerance``;
      +-inf only where ``inf_ok`` (the declared chain may overflow there);
    * ``expected`` +-inf: ``got`` that same infinity; the tolerance plays no part;
    * ``expected`` NaN: only where ``nan_ok``, and then ``got`` NaN (ValueError elsewhere:
      leave such positions out with ``where``);
    * ``got`` NaN is accepted only where ``nan_ok``.

    ``tolerance`` must be >= 0 (inf allowed) wherever compared: a NaN one would accept anything
    (ValueError naming ``name``).
    """
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    shape = np.broadcast_shapes(got.shape, expected.shape)
    where = np.broadcast_to(np.asarray(where, dtype=bool), shape)
    nan_ok = np.broadcast_to(np.asarray(nan_ok, dtype=bool), shape)
    tolerance = _checked_bound(name, np.broadcast_to(tolerance, shape), where)
    unexpected_nan = where & np.isnan(expected) & ~nan_ok
    if unexpected_nan.any():
        at = tuple(int(i) for i in np.argwhere(unexpected_nan)[0])
        raise ValueError(
            f"expected is NaN at {int(unexpected_nan.sum())} compared positions where NaN is "
            f"not allowed, first at {at}: leave them out (where=) or allow NaN there (nan_ok=)"
        )
    finite = np.isfinite(expected)
    lo = 0.0
    if expected_lo is not None:
        lo = np.asarray(expected_lo, dtype=np.float64)
        lo = np.where(finite & np.isfinite(lo), lo, 0.0)
    accepted = (
        (finite & np.isfinite(got) & (_abs_error(got, expected, lo) <= tolerance))
        | (finite & np.isinf(got) & inf_ok)
        | (np.isinf(expected) & (got == expected))
        | (np.isnan(got) & nan_ok)
    )
    return where & ~accepted


def _abs_error(a: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """``|a - (hi + lo)|``; equal infinities give 0, a NaN gives inf."""
    with np.errstate(invalid="ignore"):
        err = np.abs(np.where(a == hi, 0.0, a - hi) - lo)
    return np.where(np.isnan(err), np.inf, err)


def _on_rows(
    actual: AttentionResult,
    reference: AttentionResult,
    bound: np.ndarray | None,
    lse_bound: np.ndarray | None,
    v_range: np.ndarray | None,
    output_dtype: str,
    row_mask: np.ndarray,
    undefined: np.ndarray | None = None,
) -> ErrorReport:
    """:func:`compare` on the ``row_mask`` rows only, gathered as one ``[1, n, 1, Dv]`` case:
    the cost follows the rows checked, not ``B Sq Hq Dv``; the worst index is mapped back."""
    b, h, i = np.nonzero(row_mask)

    def o_rows(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x)[b, i, h][None, :, None, :]

    def per_row(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x)[b, h, i][None, None, :]

    gathered = AttentionResult(o=o_rows(actual.o), lse=per_row(actual.lse))
    if hasattr(reference, "o_lo"):  # an ExactResult (or exact gradients): o_lo, rows, radii
        ref = dataclasses.replace(
            reference,
            **{name: o_rows(getattr(reference, name)) for name in ("o", "o_lo")},
            **{
                name: per_row(getattr(reference, name))
                for name in ("lse", "rows", "o_err_bound", "lse_err_bound")
                if hasattr(reference, name)
            },
        )
    else:
        ref = AttentionResult(o=o_rows(reference.o), lse=per_row(reference.lse))
    report = compare(
        gathered,
        ref,
        bound=o_rows(bound),
        output_dtype=output_dtype,
        lse_bound=per_row(lse_bound),
        v_range=per_row(v_range),
        undefined=o_rows(undefined),
    )
    if report.worst_index is None:
        return report
    _, k, _, c = report.worst_index
    return dataclasses.replace(report, worst_index=(int(b[k]), int(i[k]), int(h[k]), c))


def _as_shape(name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.shape != shape:
        raise ValueError(f"{name} shape {x.shape} must equal reference.o's shape {shape}")
    return x


def _vacuous(
    bound: np.ndarray | None, v_range: np.ndarray | None, shape: tuple[int, ...]
) -> np.ndarray:
    """Elements whose bound is inf or >= their row's V range (where that range is > 0)."""
    if bound is None:
        return np.zeros(shape, dtype=bool)
    out = np.isinf(bound)
    if v_range is not None:
        B, Sq, Hq, _ = shape
        v_range = np.asarray(v_range, dtype=np.float64)
        if v_range.shape != (B, Hq, Sq):
            raise ValueError(f"v_range shape {v_range.shape} must be [B, Hq, Sq]={(B, Hq, Sq)}")
        per_element = v_range.transpose(0, 2, 1)[..., None]
        out |= (per_element > 0) & (bound >= per_element)
    return out


def _checked_bound(name: str, bound: np.ndarray, evaluated: np.ndarray) -> np.ndarray:
    """``bound`` as float64; ValueError if it is NaN or negative on an evaluated element
    (``err > NaN`` is False, so such a bound would silently pass anything)."""
    bound = np.asarray(bound, dtype=np.float64)
    bad = evaluated & ~(bound >= 0)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be >= 0 (inf allowed) on every evaluated element: {int(bad.sum())} "
            f"are NaN or negative, first at {where} = {bound[where]!r}"
        )
    return bound


def _row_mask(shape: tuple[int, ...], *masks: np.ndarray | None) -> np.ndarray:
    """AND of the given bool ``[B, Hq, Sq]`` row selections (all rows when none)."""
    B, Sq, Hq, _ = shape
    out = np.ones((B, Hq, Sq), dtype=bool)
    for mask in masks:
        if mask is None:
            continue
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (B, Hq, Sq):
            raise ValueError(
                f"rows must be a bool array of shape [B, Hq, Sq]={(B, Hq, Sq)}, "
                f"got dtype={mask.dtype} shape={mask.shape}"
            )
        out &= mask
    return out


def _lse_errors(
    actual: AttentionResult,
    reference: AttentionResult,
    row_mask: np.ndarray,
    lse_bound: np.ndarray | None,
) -> tuple[float | None, int]:
    """(max |lse error|, mismatched rows) over evaluated rows; (None, 0) without two LSEs."""
    if actual.lse is None or reference.lse is None:
        return None, 0
    ref = np.asarray(reference.lse, dtype=np.float64)
    act = np.asarray(actual.lse, dtype=np.float64)
    for name, x in (("reference.lse", ref), ("actual.lse", act)):
        if x.shape != row_mask.shape:
            raise ValueError(f"{name} shape {x.shape} must equal [B, Hq, Sq]={row_mask.shape}")
    evaluated = row_mask & ~np.isnan(ref)
    err = _abs_error(act, ref, np.zeros(ref.shape))
    if lse_bound is not None and np.shape(lse_bound) != ref.shape:
        raise ValueError(f"lse_bound shape {np.shape(lse_bound)} must be {ref.shape}")
    tolerance = np.inf if lse_bound is None else lse_bound  # None: non-finite disagreements only
    mismatch = outside_tolerance(act, ref, tolerance, where=evaluated, name="lse_bound")
    max_abs = float(err[evaluated].max()) if evaluated.any() else 0.0
    return max_abs, int(mismatch.sum())
