"""Records on disk: JSON-safe values, parsing untrusted JSON, the incremental ``records.jsonl``.

Every JSON file the report reads (a resumed ``records.jsonl``, ``report.json`` for diff and
merge) goes through :func:`parse_json`: a document nested deeper than :data:`MAX_JSON_DEPTH`
is refused with ValueError (a report is a few levels deep; a deeper one would otherwise end in
RecursionError in the parser, the validator or a message's repr).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from attention_crossval.report.schema import SCHEMA_PATH, record_problem

MAX_JSON_DEPTH = 64


def clean(value):
    """JSON-safe copy: numpy scalars to Python, non-finite floats to "inf"/"-inf"/"nan"."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return clean(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    return value


def as_float(value) -> float | None:
    """A record number back as float ("inf" strings included); None stays None."""
    return None if value is None else float(value)


class NotJSON(ValueError):
    """Text that does not decode as JSON (for a ``records.jsonl`` line: a torn write)."""


def parse_json(text: str, where: str) -> Any:
    """``json.loads(text)``; ValueError starting with ``where`` when it is not JSON or nested
    deeper than :data:`MAX_JSON_DEPTH`."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        depth = MAX_JSON_DEPTH + 1
    except json.JSONDecodeError as error:
        raise NotJSON(f"{where} is not JSON: {error}") from None
    else:
        depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, (dict, list)):
            stack.extend((child, depth + 1) for child in children)
    return deepest


def read_records(path: Path, *, skip_torn: bool) -> dict[str, dict]:
    """The records of a ``records.jsonl`` by key (a key's last line wins, as a resumed run
    reads them). A line that is not JSON is a torn write: dropped with ``skip_torn``, else an
    error; a JSON line that is not a record (schema, :func:`report.schema.record_problem`) is
    always an error naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from None
    records: dict[str, dict] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = parse_json(line, where)
        except NotJSON:
            if skip_torn:
                continue
            raise
        problem = record_problem(record)
        if problem is not None:
            raise ValueError(f"{where} does not match {SCHEMA_PATH.name}: {problem}")
        records[record["key"]] = record
    return records


class RecordLog:
    """``records.jsonl``: one JSON line per finished record, flushed as written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict]:
        """Records already written, by key; a torn line (interrupted write) is dropped, a line
        that is JSON but not a record is refused (ValueError naming file and line)."""
        if not self.path.exists():
            return {}
        try:
            return read_records(self.path, skip_torn=True)
        except ValueError as error:
            raise ValueError(f"{error}; remove that line or rerun with --fresh") from None

    def append(self, records: Iterable[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as stream:
            if stream.seek(0, 2) > 0:
                stream.seek(-1, 2)
                if stream.read(1) != b"\n":
                    stream.write(b"\n")  # end a torn line so the next record starts cleanly
            for record in records:
                stream.write(json.dumps(record, allow_nan=False).encode() + b"\n")
            stream.flush()
