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
import tempfile
import zipfile
import zlib
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


# What reading a torn, truncated or foreign ``.npz`` raises (zipfile: NotImplementedError for a
# header field it cannot read); such an entry is a miss, rewritten.
_UNREADABLE = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    EOFError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


class ExactCache:
    """``exact_attention`` results stored as ``.npz`` under ``directory`` (None: memory only).

    Writes are atomic and private to their writer (a unique temporary name, then
    ``os.replace``), so concurrent writers never see or clobber each other's partial files;
    an unreadable entry counts as a miss and is rewritten."""

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
                with path.open("rb") as stream, np.load(stream) as data:  # closed on errors
                    fields = {name: data[name] for name in data.files}
                fields["prec_bits"] = int(fields["prec_bits"])
                self.hits += 1
                return ExactResult(**fields)
            except _UNREADABLE:
                path.unlink(missing_ok=True)  # torn or corrupted: recompute and rewrite
        self.misses += 1
        result = exact_attention(case, rows, prec_bits=prec_bits)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
            try:
                with os.fdopen(descriptor, "wb") as stream:
                    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
                    np.savez(stream, **fields)
                os.replace(partial, path)
            except BaseException:
                Path(partial).unlink(missing_ok=True)
                raise
        return result
