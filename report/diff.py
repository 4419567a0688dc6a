"""Compare two reports record by record, matched on (config name, kernel name).

A record regresses when its verdict gets worse (pass -> fail/error) or when its error-to-bound
fraction grows by more than ``rel_increase`` relatively *and* ``min_increase`` absolutely (so
noise on tiny fractions does not alarm). Improvements, added and removed records are listed too.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from attention_crossval.report.markdown import fmt
from attention_crossval.report.records import as_float, read_records
from attention_crossval.report.session import read_report

_RANK = {"pass": 0, "known": 0, "unsupported": 0, "fail": 1, "error": 2}


def load_records(path: str | Path) -> list[dict]:
    """Records of a ``report.json`` or a ``records.jsonl`` (a run still in progress), checked
    against the report schema; an error names the file (and the line of a ``.jsonl``)."""
    path = Path(path)
    if path.suffix != ".jsonl":
        return read_report(path)["records"]
    records = read_records(path, skip_torn=False)
    pairs = Counter((r["config"]["name"], r["kernel"]["name"]) for r in records.values())
    twice = [pair for pair, count in pairs.items() if count > 1]
    if twice:
        raise ValueError(
            f"{path} holds two records of (config, kernel) {twice[0]} under different keys "
            "(runs with other options or config recipes): diff a finished report.json instead"
        )
    return list(records.values())


def _fraction(record: dict) -> float | None:
    if record["status"] != "ok" or "primary_pair" not in record:  # no forward pass
        return None
    return as_float(record["pairs"][record["primary_pair"]]["max_bound_fraction"])


def diff_records(
    old: list[dict], new: list[dict], *, rel_increase: float = 0.5, min_increase: float = 0.05
) -> list[dict]:
    """One row per (config, kernel) in either report: ``change`` is regression, improvement,
    same, added or removed; ``why`` says what moved."""
    if not all(math.isfinite(x) and x >= 0 for x in (rel_increase, min_increase)):  # NaN: never
        raise ValueError(
            f"rel_increase={rel_increase}, min_increase={min_increase} must be finite and >= 0"
        )

    def keyed(records):
        return {(r["config"]["name"], r["kernel"]["name"]): r for r in records}

    before, after = keyed(old), keyed(new)
    rows = []
    for key in list(before) + [k for k in after if k not in before]:
        a, b = before.get(key), after.get(key)
        row = {
            "config": key[0],
            "kernel": key[1],
            "old_verdict": a and a["verdict"],
            "new_verdict": b and b["verdict"],
            "old_fraction": a and _fraction(a),
            "new_fraction": b and _fraction(b),
        }
        row["change"], row["why"] = _classify(row, rel_increase, min_increase)
        rows.append(row)
    return rows


def _classify(row: dict, rel_increase: float, min_increase: float) -> tuple[str, str]:
    old_v, new_v = row["old_verdict"], row["new_verdict"]
    if old_v is None:
        return "added", f"new record ({new_v})"
    if new_v is None:
        return "removed", f"record gone (was {old_v})"
    if _RANK[new_v] > _RANK[old_v]:
        return "regression", f"verdict {old_v} -> {new_v}"
    if _RANK[new_v] < _RANK[old_v]:
        return "improvement", f"verdict {old_v} -> {new_v}"
    old_f, new_f = row["old_fraction"], row["new_fraction"]
    if old_f is None or new_f is None:
        return "same", ""
    if math.isinf(new_f) and not math.isinf(old_f):
        return "regression", "error/bound became infinite"
    grew = new_f - old_f
    if grew > min_increase and new_f > old_f * (1 + rel_increase):
        return "regression", f"error/bound {fmt(old_f)} -> {fmt(new_f)}"
    if -grew > min_increase and old_f > new_f * (1 + rel_increase):
        return "improvement", f"error/bound {fmt(old_f)} -> {fmt(new_f)}"
    return "same", ""


def render_diff(rows: list[dict], old_name: str, new_name: str) -> str:
    """Markdown: counts, then every changed row (regressions first)."""
    counts = {
        c: sum(r["change"] == c for r in rows)
        for c in ("regression", "improvement", "added", "removed", "same")
    }
    lines = [
        f"# Report diff: {old_name} -> {new_name}",
        "",
        ", ".join(f"{n} {c}" for c, n in counts.items()),
        "",
    ]
    changed = sorted(
        (r for r in rows if r["change"] != "same"), key=lambda r: r["change"] != "regression"
    )
    if changed:
        lines += [
            "| change | config | kernel | verdict | error/bound | why |",
            "|---|---|---|---|---|---|",
        ]
        for r in changed:
            flag = "**REGRESSION**" if r["change"] == "regression" else r["change"]
            verdict = f"{r['old_verdict'] or '-'} -> {r['new_verdict'] or '-'}"
            fraction = f"{fmt(r['old_fraction'])} -> {fmt(r['new_fraction'])}"
            lines.append(
                f"| {flag} | {r['config']} | {r['kernel']} | {verdict} | {fraction} | {r['why']} |"
            )
    else:
        lines.append("No changes.")
    return "\n".join(lines) + "\n"
