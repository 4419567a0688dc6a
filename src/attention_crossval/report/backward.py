"""The backward pass of a report record (``attention-report --pass backward|both``).

For each (config, kernel) the kernel's dq/dk/dv run through the backward harness
(:func:`kernel.harness.backward.run_backward_case`: poisoned padding, prefill and guards where
the adapter allows, determinism) and are compared, per gradient, like the forward's pairs:
kernel vs exact (sampled rows and keys), kernel vs float64 (every element), kernel vs streaming
(2x the bound) and streaming vs exact, in ulps of the declared backward chain's output dtype and
as a fraction of its derived bound (:mod:`kernel.harness.references_backward`). The record's
``backward``
object (schema: report/schema.json, ``$defs/backward``) holds them with the triage, the count of
vacuous bound elements per gradient and the run-to-run result.

dO is the config's ``do_distribution`` (a gradient distribution of ``properties.strategies``;
``gaussian`` when the recipe names none) seeded with the config's seed; it is not part of the
forward inputs, so it changes no forward case.
"""

from __future__ import annotations

from typing import Any

from attention_crossval.kernel.harness.backward import (
    KERNEL_VS_STREAMING_SCALE,
    run_backward_case,
    triage,
)
from attention_crossval.kernel.harness.references_backward import (
    GRADIENTS,
    BackwardReferences,
    gradient_dtype,
)

# The gradient builders, from the private module: the public strategies module loads pytest.
from attention_crossval.properties._strategies.gradients import GRADIENT_DISTRIBUTIONS, build_do
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.report.cells import first_line, fmt
from attention_crossval.report.records import as_float

PASSES = ("forward", "backward", "both")
# Severity of a record's verdict: the combined verdict of two passes is the more severe one
# ("unsupported" only when both are: a kernel without a backward still passes its forward).
_SEVERITY = {"unsupported": 0, "pass": 1, "fail": 2, "error": 3}


def backward_case(
    case: AttentionCase, seed: int, do_distribution: str = "gaussian"
) -> BackwardCase:
    """``case`` plus a dO of ``do_distribution`` seeded with ``seed``, rounded to the case's
    dtype."""
    return build_do(GRADIENT_DISTRIBUTIONS[do_distribution], case, seed)


def backward_section(
    case: AttentionCase, seed: int, kernel: Any, options: Any, do_distribution: str = "gaussian"
) -> dict:
    """The ``backward`` object of one record: ``kernel`` is a ``report.runner.Kernel``,
    ``options`` the ``RunOptions`` (tiers, rows and prec_bits of the exact tier, repeats),
    ``do_distribution`` the config's dO."""
    spec = kernel.spec
    grad_case = backward_case(case, seed, do_distribution)
    try:
        verdict = run_backward_case(
            kernel.adapter, grad_case, isolated=kernel.isolated, repeats=options.repeats,
            compare=False,
        )  # fmt: skip
    except Exception as error:  # an in-process kernel's exception is a finding, not a crash
        return _failed("error", f"{type(error).__name__}: {error}")
    if verdict.skipped is not None:
        return _failed("unsupported", verdict.skipped)
    findings = [{"check": f.check, "message": f.message} for f in verdict.findings]
    if verdict.result is None:
        return _failed("error", "; ".join(f"{f['check']}: {f['message']}" for f in findings))
    refs = BackwardReferences(
        grad_case,
        samples=options.rows if "exact" in options.tiers else 0,
        seed=options.row_seed,
        prec_bits=options.prec_bits,
        device=spec.device,
    )
    actual = verdict.result
    precision = spec.backward_precision_for(case.dtype)
    streamed = refs.streaming(precision, spec.tile_m, spec.tile_n)
    gradients: dict[str, dict] = {g: {} for g in GRADIENTS}
    for pair, tested, tier, scale in (
        ("kernel_vs_exact", actual, "exact", 1.0),
        ("kernel_vs_float64", actual, "float64", 1.0),
        ("kernel_vs_streaming", actual, "streaming", KERNEL_VS_STREAMING_SCALE),
        ("streaming_vs_exact", streamed, "exact", 1.0),
    ):
        if tier in ("exact", "streaming") and tier not in options.tiers:
            continue
        reports = refs.compare(tested, tier, spec, scale=scale)
        for g in GRADIENTS:
            gradients[g][pair] = {**reports[g].to_dict(), "bound_scale": scale}
    passed = not findings and all(
        p["passed"] for pairs in gradients.values() for p in pairs.values()
    )
    run_to_run = verdict.run_to_run
    return {
        "status": "ok",
        "message": None,
        "verdict": "pass" if passed else "fail",
        "output_dtype": gradient_dtype(spec, case.dtype),
        "gradients": gradients,
        "triage": triage(refs, spec, actual),
        "vacuous": refs.bounds(precision, spec.tile_n).vacuous(),
        "determinism": {
            "checked": options.repeats > 1,
            "required": run_to_run.required,
            "bitwise_equal": run_to_run.bitwise_equal if options.repeats > 1 else None,
            "differing": run_to_run.differing,
            "max_abs_diff": run_to_run.max_abs_diff,
        },
        "findings": findings,
        "declared": list(verdict.declared),
        "timing": {**refs.timings, "kernel_s": verdict.seconds / options.repeats},
    }


def with_backward(record: dict, section: dict, *, forward_ran: bool) -> dict:
    """``record`` with its ``backward`` object; the verdict is the more severe of the two, and
    a record without a forward pass (``forward_ran`` False) takes the backward's status."""
    verdict = max(record["verdict"], section["verdict"], key=_SEVERITY.__getitem__)
    status = record["status"] if forward_ran else section["status"]
    return {**record, "status": status, "verdict": verdict, "backward": section}


def _failed(status: str, message: str) -> dict:
    return {
        "status": status,
        "message": message,
        "verdict": "error" if status == "error" else "unsupported",
        "findings": [],
    }


BACKWARD_COLUMNS = (
    "config",
    "kernel",
    "verdict",
    "dq err/bound",
    "dk err/bound",
    "dv err/bound",
    "dq max ulp",
    "dk max ulp",
    "dv max ulp",
    "triage dq · dk · dv",
    "determ.",
)

BACKWARD_LEGEND = """\
Backward pass: dq, dk, dv of the config's dO (gaussian unless its name holds -do_NAME).
err/bound is the largest |error| / derived bound over kernel vs exact (sampled rows and keys)
and kernel vs float64 (every element), <= 1 passes; ulps are of the declared backward chain's
output dtype, at references farther from zero than their bound (near-zero ones have err/bound
only). Triage per gradient: none (all within), kernel (the kernel is off while the streaming
emulation is within: implementation bug), chain (the emulation is off too: precision chain or
bound). determ.: bitwise, or how many elements differed between runs (required only of a kernel
declaring a deterministic backward).
"""


def backward_cells(record: dict) -> list[str]:
    """The backward table's cells of one record."""
    section = record["backward"]
    config, kernel = record["config"]["name"], record["kernel"]["name"]
    checks = sorted({f["check"] for f in section.get("findings", [])})
    verdict = section["verdict"].upper() if section["verdict"] == "fail" else section["verdict"]
    verdict = f"{verdict} ({', '.join(checks)})" if checks else verdict
    if section["status"] != "ok":
        message = first_line(section.get("message"))  # the full text: below
        return [config, kernel, verdict, message] + [""] * (len(BACKWARD_COLUMNS) - 4)
    pairs = {g: section["gradients"][g] for g in GRADIENTS}
    kernel_pairs = ("kernel_vs_exact", "kernel_vs_float64")

    def worst(g: str, metric: str) -> str:
        values = [as_float(p[metric]) for name, p in pairs[g].items() if name in kernel_pairs]
        return fmt(max(values)) if values else "-"

    det = section["determinism"]
    if not det["checked"]:
        determ = "-"
    elif det["bitwise_equal"]:
        determ = "bitwise"
    else:
        determ = f"{'DIFFERS' if det['required'] else 'differs'} ({det['differing']})"
    return [
        config,
        kernel,
        verdict,
        *(worst(g, "max_bound_fraction") for g in GRADIENTS),
        *(worst(g, "max_ulp") for g in GRADIENTS),
        " · ".join(section["triage"][g] for g in GRADIENTS),
        determ,
    ]


def backward_table(records: list[dict]) -> list[str]:
    """The Markdown lines of the backward table (none when no record has a backward)."""
    rows = [backward_cells(r) for r in records if "backward" in r]
    if not rows:
        return []
    lines = ["## Backward pass", "", "| " + " | ".join(BACKWARD_COLUMNS) + " |"]
    lines.append("|" + "---|" * len(BACKWARD_COLUMNS))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, "", BACKWARD_LEGEND]
