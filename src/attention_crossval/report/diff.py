"""Compare two reports record by record, matched on (config name, kernel name), and, for
records left over on both sides, on (config name, the kernel's spec name) when that pairs them
one to one: a kernel whose ``--kernel`` path changed between the reports (its module moved) is
still compared, with a note naming both paths.

A record regresses when its verdict gets worse (pass -> fail/error) or when its error-to-bound
fraction grows by more than ``rel_increase`` relatively *and* ``min_increase`` absolutely (so
noise on tiny fractions does not alarm). Improvements, added and removed records are listed too.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from attention_crossval.report.cells import fmt
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

    def keyed(records: list[dict]) -> dict[tuple[str, str], dict]:
        return {(r["config"]["name"], r["kernel"]["name"]): r for r in records}

    before, after = keyed(old), keyed(new)
    renamed = _renamed(
        [before[k] for k in before if k not in after], [after[k] for k in after if k not in before]
    )
    rows = []
    for key in list(before) + [k for k in after if k not in before]:
        if key in renamed.values():  # the new side of a renamed pair: listed with its old one
            continue
        a = before.get(key)
        b = after.get(renamed.get(key, key))
        row = {
            "config": key[0],
            "kernel": key[1] if key not in renamed else f"{key[1]} -> {renamed[key][1]}",
            "old_verdict": a and a["verdict"],
            "new_verdict": b and b["verdict"],
            "old_fraction": a and _fraction(a),
            "new_fraction": b and _fraction(b),
        }
        row["change"], row["why"] = _classify(row, rel_increase, min_increase)
        if key in renamed:
            note = f"kernel path renamed, matched by spec name {a['kernel'].get('spec_name')!r}"
            row["why"] = f"{row['why']}; {note}" if row["why"] else note
        rows.append(row)
    return rows


def _renamed(gone: list[dict], appeared: list[dict]) -> dict[tuple[str, str], tuple[str, str]]:
    """Old (config, kernel) -> new (config, kernel) for records only one side has, paired by
    (config, spec name) where exactly one record on each side has that pair."""

    def by_spec(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
        grouped: dict[tuple[str, str], list[dict]] = {}
        for r in records:
            spec = r["kernel"].get("spec_name")
            if spec is not None:
                grouped.setdefault((r["config"]["name"], spec), []).append(r)
        return grouped

    old, new = by_spec(gone), by_spec(appeared)
    return {
        (olds[0]["config"]["name"], olds[0]["kernel"]["name"]): (
            news[0]["config"]["name"],
            news[0]["kernel"]["name"],
        )
        for key, olds in old.items()
        if len(olds) == 1 and len(news := new.get(key, [])) == 1
    }


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
    """Markdown: counts, a note on kernels matched across a renamed path, then every changed
    row (regressions first)."""
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
    renamed = sorted({r["kernel"] for r in rows if " -> " in r["kernel"]})
    if renamed:
        lines += [f"Kernel path renamed (records matched by spec name): {', '.join(renamed)}", ""]
    changed = sorted(
        (r for r in rows if r["change"] != "same" or " -> " in r["kernel"]),
        key=lambda r: r["change"] != "regression",
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


def failed(rows: list[dict]) -> bool:
    """Whether the diff should exit nonzero: a regression, or a record that disappeared."""
    return any(r["change"] in ("regression", "removed") for r in rows)
