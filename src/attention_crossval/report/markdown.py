"""Markdown summary of a report: header (machine, options, verdicts) and one table row per
(config, kernel), with the three tier pairs' error-to-bound fractions side by side for triage."""

from __future__ import annotations

from attention_crossval.report.backward import backward_table
from attention_crossval.report.cells import first_line, fmt
from attention_crossval.report.summary import markdown_errors, markdown_summary

PAIR_SHORT = {
    "kernel_vs_exact": "k/e",
    "kernel_vs_streaming": "k/s",
    "streaming_vs_exact": "s/e",
}

COLUMNS = (
    "config",
    "kernel",
    "verdict",
    "max abs",
    "max rel",
    "max ulp",
    "p99 ulp",
    "err/bound",
    "worst (row, col)",
    "row max",
    "rescales",
    "LSE err",
    "non-finite",
    "determ.",
    "triage k/e · k/s · s/e",
)

LEGEND = """\
Columns refer to the primary pair (kernel vs exact; kernel vs streaming when the exact tier was
not run). Ulps are units of the output dtype at the correctly rounded exact value, counted
where the exact value lies farther from zero than its bound (near-zero references have only
their absolute error against the bound, in err/bound); err/bound is
the largest |error| / derived bound (docs/numerics.md#error-bound), <= 1 passes. The worst
element's row is described by its largest scaled score (row max) and the running-max rescales
the streaming tier made on it with the kernel's tile size. Triage: kernel off from both
references -> kernel bug; streaming off from exact -> algorithm or precision chain; all within
-> the error is what the precision chain costs. k/s uses twice the bound (both sides err).
Verdict known: every failed check is a declared known finding of the kernel (listed below the
table, with its reason and upstream link) and every tier pair passes."""


def row_cells(record: dict) -> list[str]:
    """The table cells of one record (shared by the Markdown and HTML tables)."""
    config, kernel = record["config"]["name"], record["kernel"]["name"]
    if record["status"] != "ok" or record.get("primary_pair") not in record["pairs"]:
        message = first_line(record.get("message"))  # no forward pass; full text: below the table
        return [config, kernel, record["verdict"], message] + [""] * (len(COLUMNS) - 4)
    pair = record["pairs"][record["primary_pair"]]
    worst = record.get("worst") or {}
    det = record.get("determinism") or {"checked": False}  # optional in the schema: not checked
    determ = "-" if not det["checked"] else ("bitwise" if det["bitwise_equal"] else "DIFFERS")
    triage = " · ".join(
        fmt(record["pairs"][p]["max_bound_fraction"], 2) if p in record["pairs"] else "-"
        for p in PAIR_SHORT
    )
    worst_at = f"({worst['row']}, {worst['col']})" if worst else "-"
    verdict = record["verdict"].upper() if record["verdict"] == "fail" else record["verdict"]
    mark = "" if record["verdict"] == "known" else " (known)"  # a fail's known findings
    checks = sorted(
        {f["check"] + (mark if f.get("known") else "") for f in record.get("findings", [])}
    )
    return [
        config,
        kernel,
        f"{verdict} ({', '.join(checks)})" if checks else verdict,
        fmt(pair["max_abs"]),
        fmt(pair["max_rel"]),
        fmt(pair["max_ulp"]),
        fmt(pair["p99_ulp"]),
        fmt(pair["max_bound_fraction"]),
        worst_at,
        fmt(worst.get("row_max")),
        fmt(worst.get("rescales")),
        fmt(pair.get("lse_max_abs")),
        fmt(pair["nonfinite"]),
        determ,
        triage,
    ]


PAIR_COLUMNS = (
    "config",
    "kernel",
    "pair",
    "passed",
    "max abs",
    "max rel",
    "max ulp",
    "p99 ulp",
    "err/bound",
    "worst (b, row, head, col)",
    "LSE err",
    "non-finite",
    "mismatched / total",
)


def pair_rows(record: dict) -> list[list[str]]:
    """One row per tier pair of a record: the full metrics behind the triage column."""
    rows = []
    for name, pair in record.get("pairs", {}).items():
        worst = pair.get("worst_index")
        rows.append(
            [
                record["config"]["name"],
                record["kernel"]["name"],
                f"{PAIR_SHORT[name]} ({pair['bound_scale']:g}x bound)",
                "yes" if pair["passed"] else "NO",
                fmt(pair["max_abs"]),
                fmt(pair["max_rel"]),
                fmt(pair["max_ulp"]),
                fmt(pair["p99_ulp"]),
                fmt(pair["max_bound_fraction"]),
                "-" if worst is None else "(" + ", ".join(str(i) for i in worst) + ")",
                fmt(pair.get("lse_max_abs")),
                fmt(pair["nonfinite"]),
                f"{pair['mismatched']} / {pair['total']}",
            ]
        )
    return rows


KNOWN_COLUMNS = ("kernel", "check", "when", "reason", "link", "records")


def known_rows(records: list[dict]) -> list[list[str]]:
    """One row per (kernel, declared known finding) that covered a finding, with its count of
    records (known or not: a record may also fail for another reason)."""
    counts: dict[tuple[str, ...], int] = {}
    for record in records:
        for known in record.get("known_findings", []):
            key = (record["kernel"]["name"], *(known[f] for f in KNOWN_COLUMNS[1:-1]))
            counts[key] = counts.get(key, 0) + 1
    return [[*key, str(count)] for key, count in counts.items()]


def header_lines(report: dict) -> list[str]:
    """Provenance and totals, one fact per line."""
    machine, options = report["machine"], report["options"]
    gpu = f", GPU {machine['gpu']} (torch {machine['torch']})" if machine.get("gpu") else ""
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(report["summary"]["verdicts"].items()))
    return [
        f"Created {report['created']} on {machine['platform']}, {machine['cpu_count']} CPUs{gpu}; "
        f"Python {machine['python']}, numpy {machine['numpy']}, mpmath {machine.get('mpmath')}.",
        f"Kernels: {', '.join(report['kernels'])}. Tiers: {', '.join(options['tiers'])}; "
        f"exact tier on {options['rows']} sampled rows per case at {options['prec_bits']} bits; "
        f"{options['repeats']} kernel runs per case.",
        f"Records: {report['summary']['records']} ({verdicts}); "
        f"this run took {report['elapsed_s']:.1f} s ({report.get('resumed_records', 0)} resumed).",
    ]


def input_class_lines(classes: dict[str, list[str]] | None) -> list[str]:
    """The input classes real bugs need and how many of the report's configs reach each (read
    from the built cases: ``report.grid_classes``); none for a report written without them."""
    if not classes:
        return []
    lines = ["## Input classes reached", "", "| class | configs | e.g. |", "|---|---|---|"]
    for name, configs in classes.items():
        example = configs[0] if configs else "**none**"
        lines.append(f"| {name} | {len(configs)} | {example} |")
    return lines


def render_markdown(report: dict) -> str:
    lines = ["# Attention kernel error report", ""]
    lines += [f"- {line}" for line in header_lines(report)]
    lines += ["", *markdown_summary(report["records"])]
    lines += ["", *input_class_lines(report.get("input_classes"))]
    if report["options"].get("passes", "forward") != "backward":
        lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row_cells(r)) + " |" for r in report["records"]]
        lines += ["", LEGEND, ""]
    known = known_rows(report["records"])
    if known:
        lines += ["## Known findings", ""]
        lines += ["| " + " | ".join(KNOWN_COLUMNS) + " |", "|" + "---|" * len(KNOWN_COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in known]
        lines += [""]
    lines += backward_table(report["records"])
    lines += markdown_errors(report["records"])
    return "\n".join(lines)
