"""What the harness (:mod:`kernel.harness`) reports: findings per check, one verdict per case."""

from __future__ import annotations

from dataclasses import dataclass

from attention_crossval.reference.case import AttentionResult

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
        """Raise :class:`CheckFailed` for the first finding of ``checks`` (all when empty): that
        finding, the other checks that failed, the kernel and the one-line case summary."""
        __tracebackhide__ = True
        selected = [f for f in self.findings if not checks or f.check in checks]
        if selected:
            others = sorted({f.check for f in selected[1:]} - {selected[0].check})
            also = f"\n  also failed: {', '.join(others)}" if others else ""
            raise CheckFailed(f"{selected[0]}{also}\n  kernel {self.kernel}, case {self.case}")
