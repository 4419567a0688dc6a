"""On-disk cache of exact-tier results, keyed by everything the result depends on.

The exact tier is the slow one (mpmath, ~ms per row per 100 keys), and a report rerun after an
interruption, or with another kernel, asks for the same sampled rows of the same case again.
The key hashes the inputs' bytes, scale, mask, the row selection and ``prec_bits``, so a changed
case can never be served a stale result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from attention_crossval.reference.case import AttentionCase


def case_digest(case: AttentionCase) -> str:
    """Hash of a case's exact inputs and conventions (not its label)."""
    hasher = hashlib.sha256()
    for array in (case.q, case.k, case.v):
        hasher.update(f"{array.dtype.name}{array.shape}".encode())
        hasher.update(np.ascontiguousarray(array).tobytes())
    mask = case.mask
    hasher.update(f"{case.softmax_scale!r}|{mask.describe()}|{mask.alignment.value}".encode())
    if mask.explicit is not None:
        hasher.update(np.ascontiguousarray(mask.explicit).tobytes())
    return hasher.hexdigest()


class ExactCache:
    """``exact_attention`` results stored as ``.npz`` under ``directory`` (None: memory only)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = None if directory is None else Path(directory)
        self.hits = 0
        self.misses = 0

    def get(self, case: AttentionCase, rows: np.ndarray, prec_bits: int):
        """The exact result for ``rows`` of ``case``, computed once per key."""
        from attention_crossval.reference.exact import ExactResult, exact_attention

        hasher = hashlib.sha256(case_digest(case).encode())
        hasher.update(np.packbits(np.asarray(rows, bool)).tobytes())
        hasher.update(f"{rows.shape}|{prec_bits}".encode())
        path = None if self.directory is None else self.directory / f"{hasher.hexdigest()[:32]}.npz"
        if path is not None and path.exists():
            try:
                with np.load(path) as data:
                    fields = {name: data[name] for name in data.files}
                fields["prec_bits"] = int(fields["prec_bits"])
                self.hits += 1
                return ExactResult(**fields)
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)  # a torn write from an interrupted run: recompute
        self.misses += 1
        result = exact_attention(case, rows, prec_bits=prec_bits)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".tmp.npz")
            np.savez(
                partial, **{f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
            )
            os.replace(partial, path)
        return result
