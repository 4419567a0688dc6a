"""Audit of every harness check against non-finite expectations.

A check that compares ``|got - expected| <= tolerance`` passes any finite ``got`` when
``expected`` is infinite and the tolerance relative (``inf <= inf``): the empty-row LSE check
did, and a kernel writing a finite LSE on a row that sees no key passed. Here a correct CPU
kernel's result is changed *only* where the expected value is special: an empty row's O (0)
and LSE (-inf, or the head's sink), dq on empty rows and dk/dv on keys no query sees (0), a
reference LSE of -inf or O of 0 (the ``bound`` / ``lse`` comparison); or made NaN / +-inf
where a finite value is expected. The check owning the position must flag it, whichever
cooperative checks the adapter applies (``nonfinite`` and ``padding-read`` may be absent).
Every comparison goes through :func:`reference.compare.outside_tolerance`, whose rules are
pinned first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.references import CaseReferences, output_dtype
from attention_crossval.kernel.harness.references_backward import BackwardReferences
from attention_crossval.properties.strategies import attention_cases, backward_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import compare, outside_tolerance
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import empty_rows, hidden_keys
from attention_crossval.testing.broken.cpu_backward_faults import BrokenBackwardAdapter
from attention_crossval.testing.broken.cpu_faults import GuardedNumpyAdapter

pytestmark = pytest.mark.cpu

INF, NAN = np.inf, np.nan
# Cases of at most two K blocks and one key; an example of the kernel audits runs the kernel
# once per special value (up to 18), so they draw fewer.
AUDIT = settings(max_examples=min(settings.default.max_examples, 20), database=None)
KERNEL_AUDIT = settings(AUDIT, max_examples=min(settings.default.max_examples, 10))
MAX_LEN = 33


@pytest.mark.parametrize(
    ("got", "expected", "tolerance", "options", "flagged"),
    [
        (-1e30, -INF, INF, {}, True),  # the regression: relative tolerance of -inf is inf
        (0.0, -INF, 2**-20 * INF, {}, True),
        (INF, -INF, INF, {}, True),
        (-INF, -INF, 0.0, {}, False),
        (-INF, INF, INF, {"inf_ok": True}, True),  # an overflow keeps its sign
        (1.0, INF, INF, {"inf_ok": True}, True),
        (INF, 1.0, INF, {}, True),  # inf only where the chain may overflow
        (INF, 1.0, INF, {"inf_ok": True}, False),
        (NAN, 1.0, INF, {}, True),
        (NAN, 1.0, INF, {"nan_ok": True}, False),
        (NAN, 0.0, 0.0, {"nan_ok": True}, False),  # a declared NaN empty row
        (1.0, 0.0, 0.0, {"nan_ok": True}, True),
        (1.0, NAN, INF, {"nan_ok": True}, True),  # expected NaN: only NaN matches
        (NAN, NAN, 0.0, {"nan_ok": True}, False),
        (1.5, 1.0, 0.5, {}, False),
        (1.5, 1.0, 0.25, {}, True),
        (1.0, 1.0, 0.0, {"expected_lo": 2.0**-60}, True),  # the double-double's low part
        (5.0, 1.0, 0.0, {"where": False}, False),
    ],
)
def test_outside_tolerance_decides_non_finite_values_explicitly(
    got: float, expected: float, tolerance: float, options: dict, flagged: bool
) -> None:
    assert outside_tolerance(np.array([got]), expected, tolerance, **options).tolist() == [flagged]


@pytest.mark.parametrize(
    ("expected", "tolerance", "message"),
    [
        (NAN, 1.0, "expected is NaN at 3 compared positions where NaN is not allowed"),
        (1.0, NAN, "tolerance must be >= 0"),
        (1.0, -1.0, "tolerance must be >= 0"),
    ],
)
def test_outside_tolerance_refuses_what_would_accept_anything(
    expected: float, tolerance: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        outside_tolerance(np.zeros(3), np.full(3, expected), tolerance)


# --- the forward harness: empty-rows, nonfinite, bound, lse -----------------------------------


class _Perturbed(GuardedNumpyAdapter):
    """The guarded streaming kernel (correct) with ``edit`` applied to every call's result."""

    def __init__(self, spec, checks: frozenset[str], edit: Callable) -> None:
        super().__init__(spec=spec, checks=checks)
        self.edit = edit

    def run_guarded(self, case, *, prefill):
        result, writes = super().run_guarded(case, prefill=prefill)
        self.edit(result)
        return result, writes


def _rows_to_write(case: AttentionCase, padded_rows: str) -> np.ndarray:
    """Bool ``[B, Sq, Hq]``: the rows a kernel must write (all, or not the padded ones)."""
    lengths = np.array([case.q_length(b) for b in range(case.B)])
    valid = np.arange(case.Sq)[None, :] < lengths[:, None]
    must = valid if padded_rows == "unwritten" else np.ones_like(valid)
    return np.broadcast_to(must[..., None], (case.B, case.Sq, case.Hq))


def _pick(draw: st.DrawFn, where: np.ndarray) -> tuple[int, ...]:
    return draw(st.sampled_from([tuple(int(x) for x in i) for i in np.argwhere(where)]))


@st.composite
def forward_faults(draw: st.DrawFn) -> list[tuple]:
    """Every special value at one drawn element of an empty row and one of a non-empty row
    (where the case has them), each as :func:`_forward_fault`."""
    base = GuardedNumpyAdapter().spec
    spec = dataclasses.replace(
        base,
        sink=True,
        empty_rows=draw(st.sampled_from(["zero", "nan"])),
        padded_rows=draw(st.sampled_from(["zero", "unwritten"])),
    )
    checks = frozenset(draw(st.sets(st.sampled_from(sorted(GuardedNumpyAdapter.checks)))))
    case = draw(attention_cases(spec=spec, max_len=MAX_LEN))
    empty = empty_rows(case).transpose(0, 2, 1)
    must_write = _rows_to_write(case, spec.padded_rows)
    valid = ~empty & must_write
    if "nonfinite" not in checks and valid.any():  # +-inf is admitted where the bound is inf
        refs = CaseReferences(case, rows=0, tile_m=spec.tile_m, tile_n=spec.tile_n)
        bound, _ = refs.bounds(spec.precision_for(case.dtype), spec.tile_n)
        valid &= np.isfinite(bound).all(axis=-1)
    faults = []
    for kind, rows in (("empty", empty & must_write), ("valid", valid)):
        if not rows.any():
            continue
        b, i, h = _pick(draw, rows)
        c = draw(st.integers(0, case.Dv - 1))
        sink = -INF if case.sink is None else float(case.sink[h])
        if kind == "empty":  # O = 0 (NaN allowed where declared), LSE = -inf or the sink
            o_values = [1.0, -0.5, INF, -INF] + ([NAN] if spec.empty_rows == "zero" else [])
            lse_values = [NAN, INF, -INF] if np.isfinite(sink) else [NAN, INF, -1e30, 0.0]
            if np.isfinite(sink):
                lse_values.append(sink + max(1.0, abs(sink) * 2.0**-10))
        else:  # finite values expected
            o_values, lse_values = [NAN, INF, -INF], [NAN, INF, -INF]
        faults += [
            _forward_fault(spec, checks, case, kind, target, value, (b, i, h, c))
            for target, values in (("o", o_values), ("lse", lse_values))
            for value in values
        ]
    assume(faults)  # a padded_rows="unwritten" kernel with every q length 0 writes nothing
    return faults


def _forward_fault(
    spec: KernelSpec,
    checks: frozenset[str],
    case: AttentionCase,
    kind: str,
    target: str,
    value: float,
    index: tuple[int, int, int, int],
) -> tuple:
    """(adapter, case, what, the checks that may flag it, whether the reference checks are
    needed): the kernel writing ``value`` into ``target`` ("o", or "lse" of the row) at
    ``index`` ``(b, i, h, c)`` of an ``kind`` ("empty" or "valid") row."""
    b, i, h, c = index

    def edit(result: AttentionResult) -> None:
        if target == "o":
            result.o[b, i, h, c] = value
        else:
            result.lse[b, h, i] = value

    where = f"{target} = {value!r} at (b={b}, i={i}, h={h}) of an {kind} row"
    flaggers = {"empty-rows", "nonfinite"} if kind == "empty" else {"nonfinite", "bound", "lse"}
    needs_references = kind == "valid" and "nonfinite" not in checks
    return _Perturbed(spec, checks, edit), case, where, flaggers, needs_references


def _one_batch_sees_no_key() -> AttentionCase:
    """Batch 1 has no keys: every row of it is empty."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, S, 2, 16)).astype(np.float16) for S in (4, 9, 9))
    return AttentionCase(q, k, v, mask=Mask(k_lengths=(9, 0)))


EMPTY_BATCH = _one_batch_sees_no_key()
GUARDED_SPEC = GuardedNumpyAdapter().spec
# The regression: a finite LSE on an empty row, under the guarded kernel's own checks.
FINITE_LSE_ON_EMPTY_ROW = _forward_fault(
    GUARDED_SPEC, GuardedNumpyAdapter.checks, EMPTY_BATCH, "empty", "lse", -1e30, (1, 0, 0, 0)
)
# An infinite O on an empty row of a kernel that applies no cooperative check.
INF_O_ON_UNCHECKED_EMPTY_ROW = _forward_fault(
    GUARDED_SPEC, frozenset(), EMPTY_BATCH, "empty", "o", INF, (1, 2, 1, 3)
)


@KERNEL_AUDIT
@given(forward_faults())
@example([FINITE_LSE_ON_EMPTY_ROW])
@example([INF_O_ON_UNCHECKED_EMPTY_ROW])
def test_forward_checks_flag_changes_where_the_expected_value_is_special(faults) -> None:
    escaped = []
    for adapter, case, where, flaggers, needs_references in faults:
        verdict = run_case(adapter, case, compare=needs_references, exact_rows=0)
        if not {f.check for f in verdict.findings} & flaggers:
            escaped.append(f"{where} passed {sorted(adapter.checks)}: {verdict.findings}")
    assert not escaped, "\n".join(escaped)


@st.composite
def reference_faults(draw: st.DrawFn):
    """(spec, case, float64 reference, its bounds, [(changed copy, what)]): each copy changed at
    one drawn element, only where the reference's LSE is -inf or its O exactly 0 (with a finite
    bound), or to NaN / +-inf where it is finite; every such value where the case has them."""
    spec = GuardedNumpyAdapter().spec
    case = draw(attention_cases(spec=spec, max_len=MAX_LEN))
    refs = CaseReferences(case, rows=0, tile_m=spec.tile_m, tile_n=spec.tile_n)
    reference = refs.float64()
    bounds = refs.bounds(spec.precision_for(case.dtype), spec.tile_n)
    finite_bound = np.isfinite(bounds[0])
    o, lse = reference.o, reference.lse
    choices = {
        ("lse", "-inf"): (np.isneginf(lse), (0.0, -1e30, INF, NAN)),
        ("o", "0"): ((o == 0) & finite_bound, (NAN, INF, -INF, "past the bound")),
        ("o", "finite"): (np.isfinite(o) & finite_bound, (NAN, INF, -INF)),
        ("lse", "finite"): (np.isfinite(lse), (NAN, INF, -INF)),
    }
    changes = []
    for (target, expected), (where, values) in choices.items():
        if not where.any():
            continue
        index = _pick(draw, where)
        for value in values:
            changed = {"o": np.array(o), "lse": np.array(lse)}
            if value == "past the bound":  # only where O is 0
                value = 2 * bounds[0][index] + 1.0
            changed[target][index] = value
            what = f"{target} = {changed[target][index]!r} at {index} where {expected} is expected"
            changes.append((AttentionResult(**changed), what))
    return spec, case, reference, bounds, changes


@AUDIT
@given(reference_faults())
def test_bound_and_lse_comparisons_flag_changes_where_the_reference_is_special(faults) -> None:
    spec, case, reference, (bound, lse_bound), changes = faults
    escaped = []
    for changed, what in changes:
        report = compare(
            changed, reference, bound=bound, lse_bound=lse_bound,
            output_dtype=output_dtype(spec, case.dtype),
        )  # fmt: skip
        if report.mismatched + report.lse_mismatched == 0:
            escaped.append(f"{what} passed: {report.summary()}")
    assert not escaped, "\n".join(escaped)


# --- the backward harness: zero-grad, nonfinite, dq/dk/dv-bound --------------------------------


class _PerturbedBackward(BrokenBackwardAdapter):
    """The correct CPU backward with ``edit`` applied to every call's gradients."""

    def __init__(self, spec, checks: frozenset[str], edit: Callable) -> None:
        super().__init__(spec=spec, backward_checks=checks)
        self.edit = edit

    def run_backward_guarded(self, case, *, prefill):
        grads, writes = super().run_backward_guarded(case, prefill=prefill)
        self.edit(grads)
        return grads, writes


@st.composite
def backward_faults(draw: st.DrawFn) -> list[tuple]:
    """Every special value at one drawn element of a gradient where 0 or a finite value is
    expected, each as :func:`_backward_fault`."""
    base = BrokenBackwardAdapter().spec
    spec = dataclasses.replace(base, padded_rows=draw(st.sampled_from(["zero", "unwritten"])))
    pool = sorted(BrokenBackwardAdapter.backward_checks)
    checks = frozenset(draw(st.sets(st.sampled_from(pool))))
    case: BackwardCase = draw(backward_cases(spec=spec, max_len=MAX_LEN))
    fwd = case.forward
    dq_rows = _rows_to_write(fwd, spec.padded_rows)
    k_lengths = np.array([fwd.k_length(b) for b in range(fwd.B)])
    valid_keys = np.arange(fwd.Sk)[None, :] < k_lengths[:, None]
    keys = valid_keys if spec.padded_rows == "unwritten" else np.ones_like(valid_keys)
    dk_rows = np.broadcast_to(keys[..., None], (fwd.B, fwd.Sk, fwd.Hkv))
    zero = {
        "dq": empty_rows(fwd).transpose(0, 2, 1) & dq_rows,
        "dk": hidden_keys(fwd) & dk_rows,
        "dv": hidden_keys(fwd) & dk_rows,
    }
    must_write = {"dq": dq_rows, "dk": dk_rows, "dv": dk_rows}
    choices = [(g, "zero") for g in zero if zero[g].any()]
    choices += [(g, "finite") for g in zero if (must_write[g] & ~zero[g]).any()]
    assume(choices)
    gradient, kind = draw(st.sampled_from(choices))
    rows = zero[gradient] if kind == "zero" else must_write[gradient] & ~zero[gradient]
    needs_bounds = kind == "finite" and "nonfinite" not in checks
    references = None
    if needs_bounds:  # +-inf (and NaN where undefined) is admitted where the bound is infinite
        references = BackwardReferences(case, samples=0)
        bounds = references.bounds(spec.backward_precision_for(fwd.dtype), spec.tile_n)
        rows = rows & np.isfinite(getattr(bounds, gradient)).all(axis=-1)
        assume(rows.any())
    index = _pick(draw, rows)
    c = draw(st.integers(0, (fwd.Dv if gradient == "dv" else fwd.D) - 1))
    values = [NAN, INF, -INF] + ([1.0, -(2.0**-10)] if kind == "zero" else [])
    return [
        _backward_fault(spec, checks, case, gradient, kind, value, (*index, c), references)
        for value in values
    ]


def _backward_fault(
    spec: KernelSpec,
    checks: frozenset[str],
    case: BackwardCase,
    gradient: str,
    kind: str,
    value: float,
    index: tuple[int, int, int, int],
    references: BackwardReferences | None = None,
) -> tuple:
    """(adapter, case, what, the checks that may flag it, the references when the bound checks
    are needed): the backward writing ``value`` into ``gradient`` at ``index`` where ``kind``
    ("zero" or "finite") is expected."""

    def edit(grads: Gradients) -> None:
        getattr(grads, gradient)[index] = value

    where = f"{gradient} = {value!r} at {index} where {kind} is expected"
    flaggers = {"zero-grad", "nonfinite"} if kind == "zero" else {"nonfinite", f"{gradient}-bound"}
    return _PerturbedBackward(spec, checks, edit), case, where, flaggers, references


def _backward_case() -> BackwardCase:
    forward = _one_batch_sees_no_key()
    do = np.random.default_rng(4).standard_normal(forward.q.shape).astype(np.float16)
    return BackwardCase(forward, do)


# A NaN dq on an empty row of a kernel that applies no cooperative check.
NAN_DQ_ON_UNCHECKED_EMPTY_ROW = _backward_fault(
    BrokenBackwardAdapter().spec, frozenset(), _backward_case(), "dq", "zero", NAN, (1, 1, 0, 2)
)


@KERNEL_AUDIT
@given(backward_faults())
@example([NAN_DQ_ON_UNCHECKED_EMPTY_ROW])
def test_backward_checks_flag_changes_where_the_expected_value_is_special(faults) -> None:
    escaped = []
    for adapter, case, where, flaggers, references in faults:
        verdict = run_backward_case(
            adapter, case, compare=references is not None, samples=0, references=references
        )
        if not {f.check for f in verdict.findings} & flaggers:
            escaped.append(f"{where} passed {sorted(adapter.backward_checks)}: {verdict.findings}")
    assert not escaped, "\n".join(escaped)
