#!/usr/bin/env python3
"""Write a short excerpt of a report for docs/: provenance, verdict counts, the worst rows of
the table, and one plot (max error/bound against Sk and per distribution) as a small PNG.

    python scripts/report_excerpt.py attention-report-out/report.json docs/report-cpu-default

writes ``docs/report-cpu-default.md`` and ``docs/report-cpu-default.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attention_crossval.report.markdown import COLUMNS, LEGEND, header_lines, row_cells
from attention_crossval.report.records import as_float


def _badness(record: dict) -> float:
    if record["status"] != "ok":
        return float("inf") if record["verdict"] == "error" else -1.0
    return as_float(record["pairs"][record["primary_pair"]]["max_bound_fraction"])


def excerpt(report: dict, png_name: str, rows: int, note: str = "") -> str:
    records = sorted(report["records"], key=_badness, reverse=True)[:rows]
    command = " ".join(report.get("command", []))
    lines = [
        "# Report excerpt",
        "",
        f"Command: `{command}`",
        "",
        *[f"- {line}" for line in header_lines(report)],
        *([f"- {note}"] if note else []),
        "",
        f"The {len(records)} records with the largest error/bound (of {len(report['records'])}):",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *["| " + " | ".join(row_cells(r)) + " |" for r in records],
        "",
        LEGEND,
        "",
        f"![max error / bound vs Sk and per score distribution]({png_name})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="report.json")
    parser.add_argument("stem", type=Path, help="output path without suffix (.md and .png)")
    parser.add_argument("--rows", type=int, default=12, help="table rows (default 12)")
    parser.add_argument("--note", default="", help="one more provenance line (e.g. wall time)")
    args = parser.parse_args(argv)
    from attention_crossval.report import plots

    report = json.loads(args.report.read_text())
    args.stem.parent.mkdir(parents=True, exist_ok=True)
    png = args.stem.with_suffix(".png")
    png.write_bytes(plots.error_vs_sk_and_distribution(report["records"]))
    args.stem.with_suffix(".md").write_text(excerpt(report, png.name, args.rows, args.note))
    print(f"report_excerpt: wrote {args.stem.with_suffix('.md')} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
