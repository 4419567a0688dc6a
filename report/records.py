"""Records on disk: JSON-safe values and the incremental ``records.jsonl`` log."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np


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


class RecordLog:
    """``records.jsonl``: one JSON line per finished record, flushed as written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict]:
        """Records already written, by key; a torn last line (interrupted write) is dropped."""
        done = {}
        if not self.path.exists():
            return done
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[record["key"]] = record
        return done

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
