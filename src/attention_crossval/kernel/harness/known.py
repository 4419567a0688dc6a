"""Running a kernel with its declared known findings (kernel.contract.known_findings): which
known findings cover a verdict, the reruns a planted trigger needs, and the xfail (or Hypothesis
rejection) a covered failure becomes in pytest."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from attention_crossval.kernel.contract.known_findings import (
    KnownFinding,
    without_empty_row_gradient,
)
from attention_crossval.kernel.contract.spec import BackwardKernelAdapter, KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.backward import (
    BackwardVerdict,
    fill_backward_padding,
    run_backward_case,
)
from attention_crossval.kernel.harness.forward import fill_padding, run_case
from attention_crossval.kernel.harness.verdict import Finding, Verdict
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.gradients import BackwardCase

# The check whose trigger the harness plants itself (NaN in padding): a known one says nothing
# about the other checks, so they are run again with zero padding (:func:`run_with_known`).
_PLANTED = "padding-read"
# Backward checks whose known failure breaks the bounds as well: the case is run again without
# their trigger (:func:`run_backward_with_known`).
_RERUNNABLE = frozenset({_PLANTED, "zero-grad"})


def covering(
    spec: KernelSpec, case: AttentionCase, findings: Iterable[Finding], *, backward: bool = False
) -> tuple[KnownFinding, ...]:
    """The known findings of ``spec`` (of the backward pass if ``backward``) covering every one
    of ``findings`` on ``case``, in declaration order; empty when there is no finding or one is
    not covered."""
    applicable = [
        known for known in spec.known_findings if known.backward == backward and known.applies(case)
    ]
    checks = {finding.check for finding in findings}
    covered = {known.check for known in applicable}
    if not checks or not checks <= covered:
        return ()
    return tuple(known for known in applicable if known.check in checks)


def run_with_known(adapter: KernelAdapter, case: AttentionCase, **kwargs: Any) -> Verdict:
    """``kernel.harness.forward.run_case``; when every finding is known and one is ``padding-read``,
    the case runs again with zero padding and without that check, so the checks it blocked
    (``bound``, ``lse``, empty rows) still apply. The known findings stay in the verdict, after
    the rerun's (a failure leads with what is not known)."""
    verdict = run_case(adapter, case, **kwargs)
    known = covering(adapter.spec, case, verdict.findings)
    if not any(k.check == _PLANTED for k in known):
        return verdict
    again = run_case(adapter, fill_padding(case, 0.0), skip_checks=frozenset({_PLANTED}), **kwargs)
    planted = tuple(f for f in verdict.findings if f.check == _PLANTED)
    return replace(
        again,
        case=verdict.case,
        findings=again.findings + planted,
        applied=verdict.applied | again.applied,
        seconds=verdict.seconds + again.seconds,
    )


def run_backward_with_known(
    adapter: BackwardKernelAdapter, case: BackwardCase, **kwargs: Any
) -> BackwardVerdict:
    """``kernel.harness.backward.run_backward_case``, with :func:`run_with_known`'s rerun: when
    a known backward ``padding-read`` or ``zero-grad`` finding shows, the case runs again
    without its trigger and check, so the bounds (which such a finding also breaks) still
    apply to the rest: zero padding for ``padding-read``; for ``zero-grad``, dO = 0 on the rows
    that see no key (a kernel's garbage P on such a row then meets a zero upstream gradient, so
    it cannot reach dk/dv, while its dq there is still held to 0 by the bound). The verdict
    holds every finding of the rerun, then the known findings of the first run (a failure
    leads with what is not known)."""
    verdict = run_backward_case(adapter, case, **kwargs)
    known = _known_checks(adapter.spec, case.forward, backward=True) & _RERUNNABLE
    removed: set[str] = set()
    carried: list[Finding] = []
    seconds = verdict.seconds
    # A rerun may show a second trigger the first hid (NaN padding hides a hidden row's
    # nonzero gradient): remove it as well and run again.
    while rerun := ({f.check for f in verdict.findings} & known) - removed:
        removed |= rerun
        carried += [f for f in verdict.findings if f.check in rerun]
        again = fill_backward_padding(case, 0.0) if _PLANTED in removed else case
        if "zero-grad" in removed:
            again = without_empty_row_gradient(again)
        verdict = run_backward_case(adapter, again, skip_checks=frozenset(removed), **kwargs)
        seconds += verdict.seconds
    return replace(verdict, findings=verdict.findings + tuple(carried), seconds=seconds)


def _known_checks(spec: KernelSpec, case: AttentionCase, *, backward: bool) -> set[str]:
    return {k.check for k in spec.known_findings if k.backward == backward and k.applies(case)}


def xfail_if_known(
    verdict: Verdict, spec: KernelSpec, case: AttentionCase, *, backward: bool = False
) -> None:
    """When every failed check of ``verdict`` is a known finding of ``spec`` on ``case``:
    ``pytest.xfail`` with the reasons; inside a Hypothesis test, the example is rejected instead
    (with a Hypothesis event naming the finding), because an xfail there ends the search and
    hides the kernel's other bugs. Otherwise return (the caller raises the failures)."""
    known = covering(spec, case, verdict.findings, backward=backward)
    if not known:
        return
    reason = "; ".join(str(k) for k in known)
    # pytest and Hypothesis are needed only when a test calls this (the report never does)
    import pytest
    from hypothesis import control, event, reject

    if control.currently_in_test_context():
        event(f"known: {', '.join(k.check for k in known)}")
        reject()
    pytest.xfail(reason)
