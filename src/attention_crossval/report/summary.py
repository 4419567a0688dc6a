"""The report's opening: one line per kernel saying how many records passed and how big the
error got (worst error-to-bound of the forward and of the backward, worst ulps), each with the
config behind it, and the errored records as one line each with their messages set apart.

A verdict count alone ("84 pass") says nothing about the margin; the worst error-to-bound does:
0.4 passes with room, 0.98 barely, 164 is a bug. Ulps leave out near-zero references (see
``reference.compare``), so the worst ulp figure is one a reader can compare across kernels.
"""

from __future__ import annotations

from typing import Any

from attention_crossval.report.cells import fmt
from attention_crossval.report.records import as_float

SUMMARY_COLUMNS = (
    "kernel",
    "records",
    "verdicts",
    "worst err/bound (forward)",
    "worst err/bound (backward)",
    "worst ulp",
)
_KERNEL_PAIRS = ("kernel_vs_exact", "kernel_vs_float64", "kernel_vs_streaming")


def _worst(candidates: list[tuple[float | None, str]]) -> str:
    """``"<value> (<where>)"`` of the largest value, "-" when there is none."""
    candidates = [(v, w) for v, w in candidates if v is not None and v == v]  # no None, NaN
    if not candidates:
        return "-"
    value, where = max(candidates, key=lambda c: c[0])
    return f"{fmt(value)} ({where})"


def _forward_pairs(record: dict) -> list[dict[str, Any]]:
    """The kernel's forward pairs of an ok record, the primary one (what the verdict used)."""
    primary = record.get("primary_pair")
    if record["status"] != "ok" or primary not in record.get("pairs", {}):
        return []
    return [record["pairs"][primary]]


def _backward_pairs(record: dict) -> list[tuple[str, dict[str, Any]]]:
    """``(gradient, pair)`` of the kernel's backward pairs of an ok backward section."""
    section = record.get("backward")
    if not section or section["status"] != "ok":
        return []
    return [
        (g, pair)
        for g, pairs in section["gradients"].items()
        for name, pair in pairs.items()
        if name in _KERNEL_PAIRS and name != "kernel_vs_streaming"
    ]


def kernel_rows(records: list[dict]) -> list[list[str]]:
    """One row per kernel (in report order): :data:`SUMMARY_COLUMNS`."""
    rows = []
    for kernel in dict.fromkeys(r["kernel"]["name"] for r in records):
        mine = [r for r in records if r["kernel"]["name"] == kernel]
        counts: dict[str, int] = {}
        for record in mine:
            counts[record["verdict"]] = counts.get(record["verdict"], 0) + 1
        forward, backward, ulps = [], [], []
        for record in mine:
            config = record["config"]["name"]
            for pair in _forward_pairs(record):
                forward.append((as_float(pair["max_bound_fraction"]), config))
                ulps.append((as_float(pair["max_ulp"]), f"{config}, forward"))
            for gradient, pair in _backward_pairs(record):
                backward.append((as_float(pair["max_bound_fraction"]), f"{config}, {gradient}"))
                ulps.append((as_float(pair["max_ulp"]), f"{config}, {gradient}"))
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda c: -c[1]))
        rows.append(
            [kernel, str(len(mine)), verdicts, _worst(forward), _worst(backward), _worst(ulps)]
        )
    return rows


def error_records(records: list[dict]) -> list[tuple[str, str]]:
    """``(config [kernel] (pass), message)`` of every errored record or backward section."""
    errors = []
    for record in records:
        where = f"{record['config']['name']} [{record['kernel']['name']}]"
        if record["status"] == "error" and record.get("message"):
            errors.append((where, record["message"]))
        section = record.get("backward") or {}
        if section.get("status") == "error" and section.get("message"):
            errors.append((f"{where} (backward)", section["message"]))
    return errors


def markdown_summary(records: list[dict]) -> list[str]:
    """The Markdown lines of the per-kernel summary."""
    lines = ["## Summary per kernel", ""]
    lines += ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in kernel_rows(records)]
    return [*lines, ""]


def markdown_errors(records: list[dict]) -> list[str]:
    """The Markdown lines giving each errored record's full message (none when no error)."""
    errors = error_records(records)
    if not errors:
        return []
    lines = ["## Errors", ""]
    for where, message in errors:
        lines += [f"### {where}", "", "```", message.rstrip(), "```", ""]
    return lines
