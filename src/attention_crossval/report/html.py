"""A self-contained HTML page: the summary table plus the figures as inline base64 PNGs.

Importing this module imports matplotlib; :mod:`report.session` catches the ImportError and
writes JSON and Markdown only. Every figure is an ``<img class="plot">``, so
scripts/check_html_render.py can count the images a browser actually decoded.
"""

from __future__ import annotations

import base64
import html

from attention_crossval.report import plots
from attention_crossval.report.cells import first_line
from attention_crossval.report.markdown import (
    COLUMNS,
    KNOWN_COLUMNS,
    LEGEND,
    PAIR_COLUMNS,
    header_lines,
    known_rows,
    pair_rows,
    row_cells,
)
from attention_crossval.report.summary import SUMMARY_COLUMNS, error_records, kernel_rows

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; white-space: nowrap; }
td:nth-child(-n+2) { text-align: left; }
tr.pass td:nth-child(3) { background: #d9f2d9; }
tr.fail td:nth-child(3), tr.error td:nth-child(3) { background: #f7c6c6; font-weight: bold; }
tr.known td:nth-child(3) { background: #fbe8b4; }
tr.unsupported td { color: #888; }
img.plot { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
p.note { font-size: 12px; max-width: 60em; }
"""


def _figure(title: str, png: bytes, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (
        f"<h2>{html.escape(title)}</h2><p class='note'>{html.escape(caption)}</p>"
        f"<img class='plot' alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
    )


def figures(records: list[dict]) -> list[str]:
    """The page's figure sections, in reading order."""
    if not plots.plottable(records):  # no forward output (or only backward records)
        return ["<p>No kernel produced output: nothing to plot.</p>"]
    sections = [
        _figure(
            "Error histogram per configuration",
            plots.histograms(records),
            "log10(|error| / bound) per element against the exact tier on its sampled rows (or "
            "the float64 result on all rows without it). Left: every configuration, worst on "
            "top, colour = share of its elements per bin; right: the worst configurations' "
            "histograms. Red line: the bound.",
        ),
        _figure(
            "Error vs Sk and vs score distribution",
            plots.error_vs_sk_and_distribution(records),
            "Max |error| / bound per configuration; red line: the bound.",
        ),
        _figure(
            "Error-to-bound over query rows",
            plots.row_heatmap(records),
            "Max |error| / bound per row bin against the float64 streaming result on all rows "
            "(big cases: the evaluated row subset; bins without one are black).",
        ),
    ]
    comparison = plots.kernel_comparison(records)
    if comparison is not None:
        sections.append(
            _figure(
                "Kernel vs kernel",
                comparison,
                "Max |error| / bound of each kernel against the first kernel, per configuration.",
            )
        )
    return sections


def _table(columns, rows, classes=None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        f"<tr class='{cls}'>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row, cls in zip(rows, classes or [""] * len(rows), strict=True)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _errors(records: list[dict]) -> str:
    """Each errored record's full message in a details block (empty when none errored)."""
    blocks = "".join(
        f"<details><summary>{html.escape(where)}: {html.escape(first_line(message))}</summary>"
        f"<pre>{html.escape(message)}</pre></details>"
        for where, message in error_records(records)
    )
    return f"<h2>Errors</h2>{blocks}" if blocks else ""


def render_html(report: dict) -> str:
    records = report["records"]
    header = "".join(f"<li>{html.escape(line)}</li>" for line in header_lines(report))
    overview = _table(SUMMARY_COLUMNS, kernel_rows(records))
    summary = _table(COLUMNS, [row_cells(r) for r in records], [r["verdict"] for r in records])
    pairs = _table(PAIR_COLUMNS, [row for r in records for row in pair_rows(r)])
    known = known_rows(records)
    known_section = f"<h2>Known findings</h2>{_table(KNOWN_COLUMNS, known)}" if known else ""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        "<title>Attention kernel error report</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>Attention kernel error report</h1>"
        f"<ul>{header}</ul>"
        f"<h2>Summary per kernel</h2><div id='summary'>{overview}</div>"
        + "".join(figures(records))
        + f"<h2>Results</h2>{summary}<p class='note'>{html.escape(LEGEND)}</p>{known_section}"
        + _errors(records)
        + f"<details><summary>Every tier pair in full</summary>{pairs}</details>"
        "</body></html>"
    )
