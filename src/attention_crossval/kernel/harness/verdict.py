"""What the harness (:mod:`kernel.harness.forward`) reports: findings per check, one verdict
per case, and the triage hint for ``bound`` / ``lse`` failures (:func:`chain_hint`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import FP8_DTYPES, AttentionResult
from attention_crossval.reference.precision import HOPPER_FP8_MMA_BITS, StreamingPrecision


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


def neighbour_chains(
    chain: StreamingPrecision, input_dtype: str
) -> list[tuple[StreamingPrecision, str, str]]:
    """Precision chains one declaration slip away from ``chain``: ``(chain, the fields that
    change, the question a kernel author should ask)``. The slips: which P the row sum adds,
    whether P is rounded before P V, and (FP8) whether the MMA keeps Hopper's narrow
    accumulator."""
    if chain.p_dtype is not None:
        rounded = not chain.row_sum_from_rounded_p
        which = "rounded" if rounded else "unrounded"
        unrounded_p = dataclasses.replace(
            chain,
            p_dtype=None,
            row_sum_from_rounded_p=False,
            mma_accumulator_bits=None,  # an unrounded P is no FP8 MMA operand
            mma_promotion_interval=None,
        )
        out = [
            (
                dataclasses.replace(chain, row_sum_from_rounded_p=rounded),
                f"row_sum_from_rounded_p={rounded}",
                f"did the kernel sum the {which} P?",
            ),
            (unrounded_p, "p_dtype=None", "does the kernel multiply V by the unrounded P?"),
        ]
        if chain.p_dtype in FP8_DTYPES and chain.mma_accumulator_bits is None:
            out.append(
                (
                    dataclasses.replace(chain, mma_accumulator_bits=HOPPER_FP8_MMA_BITS),
                    f"mma_accumulator_bits={HOPPER_FP8_MMA_BITS}",
                    "does the kernel's FP8 MMA accumulate in Hopper's narrow accumulator?",
                )
            )
        return out
    if input_dtype not in ("float16", "bfloat16"):
        return []
    return [
        (
            dataclasses.replace(chain, p_dtype=input_dtype, row_sum_from_rounded_p=from_rounded),
            f"p_dtype={input_dtype!r}, row_sum_from_rounded_p={from_rounded}",
            f"does the kernel round P to {input_dtype} before P V?",
        )
        for from_rounded in (False, True)
    ]


def chain_hint(
    spec: KernelSpec, input_dtype: str, recheck: Callable[[KernelSpec], list[Finding]]
) -> str | None:
    """The first neighbouring chain (:func:`neighbour_chains`) under which the kernel's result
    raises no ``bound`` / ``lse`` finding (``recheck(spec declaring that chain)``), as a hint
    line, or None. A faithful kernel that declared the wrong chain then says so."""
    declared = spec.precision_for(input_dtype)
    for chain, change, question in neighbour_chains(declared, input_dtype):
        other = dataclasses.replace(spec, precision={**spec.precision, input_dtype: chain})
        if not any(f.check in ("bound", "lse") for f in recheck(other)):
            return f"would pass under the declared chain with {change}: {question}"
    return None
